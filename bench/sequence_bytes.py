"""The sequence all-to-all's bytes: recxla's EmbeddingCollection sharder against TorchRec's, on the
same batches, counted by one instrument (the trainer's CommMeter).

    .venv/bin/python -m bench.sequence_bytes --ranks 4 --steps 3

The batches: the trainer's synthetic logs with `--model history` (recxla.train.data: the
Criteo profile, users' histories of 20-200 items, Zipf 1.05, tables capped at 100k rows),
`--batch` samples per rank; the module: an EmbeddingCollection of the history table (dim 64)
alone, planned table-wise and row-wise, trained with fused SGD (a loss of random weights on
every row of its output). Each variant runs on the same ranks over loopback, one after another;
per step and over all ranks, the bytes sent to other ranks by kind: ids (the input dist), rows
(forward) and their gradients (backward). TorchRec's EC sharder carries one row per id of a
rank's batch (fp32, or its bf16 codec); recxla's one row per unique id per owner and rank (fp32,
or FP8 rows with a scale each). Rows are the bytes a link carries; the ratio column is against
TorchRec bf16's rows + gradients (its fastest CPU configuration).
"""

import argparse
import datetime
import json
import os
import socket
import sys
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = {
    "torchrec fp32": ("torchrec", "fp32", "fp32"),
    "torchrec bf16": ("torchrec", "bf16", "bf16"),
    "recxla fp32": ("recxla", "fp32", "fp32"),
    "recxla e4m3/bf16": ("recxla", "e4m3", "bf16"),
    "recxla e4m3/e5m2": ("recxla", "e4m3", "e5m2"),
}
KINDS = ("ids", "rows", "gradients")


def _sharder(path: str, fwd: str, bwd: str):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.01}
    if path == "recxla":
        import recxla.torchrec

        return recxla.torchrec.EmbeddingCollectionSharder(fused_params=fused, fwd_comm=fwd,
                                                           bwd_comm=bwd)
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs
    from torchrec.distributed.types import CommOp

    registry = None
    if fwd != "fp32":
        registry = {CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.name: get_qcomm_codecs(QCommsConfig(
            forward_precision=CommType(fwd), backward_precision=CommType(bwd)))}
    return EmbeddingCollectionSharder(fused_params=fused, qcomm_codecs_registry=registry)


def _rank(rank: int, world: int, port: int, args, out: str) -> None:
    from torchrec.distributed.planner import (EmbeddingShardingPlanner, ParameterConstraints,
                                              Topology)
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    from recxla.train.comm_meter import CommMeter
    from recxla.train.config import TrainConfig
    from recxla.train.data import TrainData

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    config = TrainConfig(model="history", batch_size=args.batch, max_rows=args.max_rows,
                         seed=args.seed, loader_workers=0)
    data = TrainData(config, rank, world)
    history, _ = data.history_features()
    table = next(t for t in data.tables(args.dim) if history in t.feature_names)
    configs = [EmbeddingConfig(name=table.name, embedding_dim=args.dim,
                               num_embeddings=table.num_embeddings, feature_names=[history])]
    batches = [b.sparse_features for _, b in zip(range(args.steps), data.train(0, args.steps))]
    batches = [b.permute([b.keys().index(history)]) for b in batches]
    ids = sum(b.values().numel() for b in batches) / len(batches)
    results: Dict[str, Dict[str, Dict[str, float]]] = {}
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    for sharding in args.shardings.split(","):
        for label in args.variants.split(","):
            path, fwd, bwd = VARIANTS[label]
            sharder = _sharder(path, fwd, bwd)
            module = EmbeddingCollection(configs)
            planner = EmbeddingShardingPlanner(
                topology=Topology(world_size=world, compute_device="cpu"),
                constraints={table.name: ParameterConstraints(sharding_types=[sharding])})
            plan = planner.collective_plan(module, [sharder], dist.group.WORLD)
            sharded = sharder.shard(module, plan.plan[""], env, torch.device("cpu"))
            meter = CommMeter()
            generator = torch.Generator().manual_seed(args.seed + rank)
            with meter.installed():
                for step, kjt in enumerate(batches):
                    meter.begin_step(step)
                    # TorchRec's ShardedModule.forward, its stages under the meter's phases
                    ctx = sharded.create_context()
                    with meter.phase("input"):
                        dist_input = sharded.input_dist(ctx, kjt).wait().wait()
                    with meter.phase("forward"):
                        rows = sharded.compute_and_output_dist(ctx, dist_input).wait()
                    loss = sum((j.values() * torch.randn(j.values().shape, generator=generator)
                                ).sum() for j in rows.values())
                    with meter.phase("backward"):
                        loss.backward()
                    meter.end_step()
            per_kind = {k: 0.0 for k in KINDS}
            for step in range(len(batches)):
                for key, sent in meter.step_comm(step).bytes_sent.items():
                    phase, kind = key.split("/", 1)
                    name = "ids" if kind == "ids" else "rows" if phase == "forward" else \
                        "gradients" if phase == "backward" else None
                    if name is not None:
                        per_kind[name] += sent / len(batches)
            results.setdefault(sharding, {})[label] = per_kind
    gathered: List[dict] = [None] * world
    dist.all_gather_object(gathered, {"results": results, "ids": ids})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--batch", type=int, default=1024, help="samples per rank")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--max-rows", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shardings", default="table_wise,row_wise")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    for v in args.variants.split(","):
        if v not in VARIANTS:
            p.error(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"sequence_bytes_{os.getpid()}.json")
    mp.spawn(_rank, args=(args.ranks, port, args, out), nprocs=args.ranks, join=True)
    with open(out) as f:
        gathered = json.load(f)
    os.unlink(out)
    ids = sum(g["ids"] for g in gathered)
    figures = {}
    print(f"{args.ranks} ranks x {args.batch} samples, histories of the synthetic logs "
          f"(--model history), {ids:,.0f} history ids a step, dim {args.dim}; bytes a step, "
          "all ranks, sent to other ranks")
    for sharding in args.shardings.split(","):
        totals = {label: {k: sum(g["results"][sharding][label][k] for g in gathered)
                          for k in KINDS} for label in args.variants.split(",")}
        base = totals.get("torchrec bf16")
        print(f"\n{sharding}:\n{'variant':<20}{'ids':>12}{'rows':>12}{'gradients':>12}"
              f"{'rows+grads vs torchrec bf16':>30}")
        for label, t in totals.items():
            ratio = (t["rows"] + t["gradients"]) / (base["rows"] + base["gradients"]) \
                if base else float("nan")
            print(f"{label:<20}{t['ids']:>12,.0f}{t['rows']:>12,.0f}{t['gradients']:>12,.0f}"
                  f"{ratio:>30.4f}")
        figures[sharding] = totals
    if args.json:
        from bench.cluster.history import run_commit, utc_now
        from bench.cluster.run_a2a import _machine

        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python", "-m", "bench.sequence_bytes"]
                                           + (argv or sys.argv[1:])),
                       "commit": run_commit(), "date": utc_now(), "machine": _machine(),
                       "ids_per_step": ids, "bytes_per_step": figures}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
