"""Small rank functions for EmulatedCluster.run: a connectivity check and a link throughput probe.

They run inside a rank (see rank.py), with the gloo process group already up unless noted.
"""

import os
import socket
import statistics
import time

from bench.cluster.rank import rank_info


def hello(payload: int = 1) -> dict:
    """Where this rank runs, and the sum of (rank + payload) over all ranks by all_reduce.

    Returns {"rank", "world_size", "node", "local_rank", "mode", "iface", "interfaces",
    "allreduce"}: `interfaces` lists the network interfaces this process sees (inside a namespace:
    only "lo" and "rx0"), `allreduce` is a float that every rank must agree on.
    """
    import torch
    import torch.distributed as dist

    info = rank_info()
    t = torch.tensor([float(info.rank + payload)])
    dist.all_reduce(t)
    return {
        "rank": info.rank,
        "world_size": info.world_size,
        "node": info.node,
        "local_rank": info.local_rank,
        "mode": info.mode,
        "iface": info.iface,
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
        "allreduce": t.item(),
    }


def all_to_all_time(bytes_per_peer: int, iters: int = 5, warmup: int = 1) -> dict:
    """Median seconds of one uint8 all_to_all_single in which every rank sends `bytes_per_peer`
    bytes to every other rank (and to itself).

    Each iteration starts after a barrier and is timed as the slowest rank's time (a collective
    is done only when its last rank is done). Returns {"bytes_per_peer", "seconds", "all"}.
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    send = torch.randint(0, 256, (bytes_per_peer * world,), dtype=torch.uint8)
    recv = torch.empty_like(send)
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(dt.item())
    return {"bytes_per_peer": bytes_per_peer, "seconds": statistics.median(times), "all": times}


def fail(message: str = "failing on purpose") -> None:
    """Raise on rank 1 (others wait for it): exercises the launcher's error path."""
    import torch.distributed as dist

    if rank_info().rank == 1:
        raise RuntimeError(message)
    dist.barrier()


def sleep(seconds: float) -> dict:
    """Sleep (no process group needed): exercises the launcher's timeout."""
    time.sleep(seconds)
    return {"pid": os.getpid()}
