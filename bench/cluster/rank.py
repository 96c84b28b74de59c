"""What runs in each rank process of an emulated cluster: `python -m bench.cluster.rank JOB RANK`.

JOB is a JSON file written by the launcher: {"target": "module:function", "kwargs": {...},
"init_process_group": bool, "timeout_s": float}. The rank reads its place in the cluster from the
environment (the same variables torchrun sets), joins the gloo process group when asked, calls
`function(**kwargs)` and writes what it returns, which must be JSON-serializable, to
$RECXLA_CLUSTER_RESULT (written to a temporary name and renamed, so a reader never sees half of
it). An exception exits with status 1 after printing its traceback to stderr.
"""

import importlib
import json
import os
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class RankInfo:
    """A rank's place in the emulated cluster.

    rank, world_size: global; node: the emulated node (namespace) it runs in; local_rank,
    local_world_size: its index and the rank count inside that node; mode: "netns" (shaped
    namespaces) or "loopback" (all ranks on 127.0.0.1); iface: the interface gloo binds to.
    """

    rank: int
    world_size: int
    node: int
    nodes: int
    local_rank: int
    local_world_size: int
    mode: str
    iface: str
    master_addr: str


def rank_info() -> RankInfo:
    """This process's RankInfo, from the variables the launcher sets."""
    env = os.environ
    return RankInfo(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        node=int(env["GROUP_RANK"]),
        nodes=int(env["RECXLA_CLUSTER_NODES"]),
        local_rank=int(env["LOCAL_RANK"]),
        local_world_size=int(env["LOCAL_WORLD_SIZE"]),
        mode=env["RECXLA_CLUSTER_MODE"],
        iface=env.get("GLOO_SOCKET_IFNAME", ""),
        master_addr=env["MASTER_ADDR"],
    )


def _resolve(target: str):
    module_name, sep, func_name = target.partition(":")
    if not sep or not module_name or not func_name:
        raise ValueError(f"bench.cluster: target must be 'module:function', got {target!r}")
    return getattr(importlib.import_module(module_name), func_name)


def _write_result(path: str, value) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job_path, rank = argv[0], int(argv[1])
    with open(job_path) as f:
        job = json.load(f)
    pg = None
    try:
        func = _resolve(job["target"])
        if job.get("init_process_group", True):
            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method="env://",
                rank=rank,
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=timedelta(seconds=float(job.get("timeout_s", 300))),
            )
            pg = dist
        result = func(**job.get("kwargs", {}))
        _write_result(os.environ["RECXLA_CLUSTER_RESULT"], result)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        # Skip the process group's teardown: peers may be stuck in a collective with this rank,
        # and the launcher ends them anyway.
        os._exit(1)
    if pg is not None:
        pg.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
