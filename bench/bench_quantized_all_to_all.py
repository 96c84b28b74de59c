"""pytest-benchmark: recxla.quantized_all_to_all on 2 gloo ranks over loopback.

This process is rank 0 and the timer; rank 1 runs in a process started by the cluster harness
(`EmulatedCluster.start_peers`) and follows rank 0's commands: before each round (untimed),
rank 0 broadcasts which case to run next, then both run it. The cases, inputs and bytes come
from bench/cluster/run_a2a.py, which runs the same exchange across emulated nodes with shaped
links (`make bench-cluster`); this file is the quick loopback view for `make bench`.

    .venv/bin/python -m pytest bench/bench_quantized_all_to_all.py --benchmark-only

extra_info per case: wire_bytes_per_rank (bytes sent to the other rank per step), bytes_ratio
(to plain fp32 all_to_all_single), fp32_gbps (fp32-equivalent payload per second, median) and
memcpy_gbps (a memcpy of the same fp32 bytes on this machine, for scale).
"""

import os
import sys
import time

import pytest
import torch

# bench/ is a folder of the repository, not of the installed package: make it importable however
# pytest is started (`pytest` does not put the working directory on sys.path).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.cluster import EmulatedCluster  # noqa: E402
from bench.cluster.run_a2a import (  # noqa: E402
    VARIANTS,
    make_inputs,
    make_step,
    sqnr_db,
    wire_bytes,
)

ROWS_PER_RANK = 32768  # D=128 fp32: 16 MiB per rank, half of it to the other rank
DIM = 128
SEED = 0
CASES = [(p, label, fwd, bwd) for p in VARIANTS for (label, fwd, bwd) in VARIANTS[p]]
STOP = -1
# Lower bounds on the SQNR (dB) of the output against the exact fp32 exchange, about 5 dB under
# what each format gives on these rows: a broken codec or a scrambled split fails them.
MIN_SQNR_DB = {"fp32": float("inf"), "bf16": 50.0, "fp16": 50.0, "e4m3": 26.0, "e5m2": 20.0}


def peer(rows_per_rank: int, dim: int, seed: int) -> dict:
    """Rank 1..W-1: run the case rank 0 broadcasts, until it broadcasts STOP."""
    import torch.distributed as dist

    inputs = make_inputs(rows_per_rank, dim, seed)
    steps = [make_step(inputs, p == "fwd+bwd", fwd, bwd) for p, _, fwd, bwd in CASES]
    cmd = torch.zeros(1, dtype=torch.int64)
    count = 0
    while True:
        dist.broadcast(cmd, src=0)
        if cmd.item() == STOP:
            return {"steps": count}
        steps[cmd.item()]()
        count += 1


@pytest.fixture(scope="module")
def pair():
    """(torch.distributed, inputs) with this process as rank 0 of 2 loopback ranks."""
    with EmulatedCluster(nodes=1, ranks_per_node=2, mode="loopback") as cluster:
        peers = cluster.start_peers(
            "bench.bench_quantized_all_to_all:peer",
            {"rows_per_rank": ROWS_PER_RANK, "dim": DIM, "seed": SEED}, timeout=600)
        threads = torch.get_num_threads()
        torch.set_num_threads(cluster.threads_per_rank)  # as many cores as the peer gets
        dist = peers.init_process_group()
        try:
            yield dist, make_inputs(ROWS_PER_RANK, DIM, SEED)
            dist.broadcast(torch.tensor([STOP]), src=0)
            assert peers.finish()[0]["steps"] > 0
        finally:
            dist.destroy_process_group()
            torch.set_num_threads(threads)


def _memcpy_gbps(nbytes: int) -> float:
    src = torch.empty(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


@pytest.mark.distributed
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_quantized_all_to_all_loopback(benchmark, pair, case):
    dist, inputs = pair
    pass_name, label, fwd, bwd = CASES[case]
    backward = pass_name == "fwd+bwd"
    step = make_step(inputs, backward, fwd, bwd)
    benchmark.group = f"quantized_all_to_all 2 ranks loopback {pass_name}"

    def tell_peer():
        dist.broadcast(torch.tensor([case]), src=0)

    out, gx = benchmark.pedantic(step, setup=tell_peer, rounds=10, warmup_rounds=2, iterations=1)

    nbytes = wire_bytes(inputs, DIM, backward, fwd, bwd)
    fp32_bytes = wire_bytes(inputs, DIM, backward, None, None)
    benchmark.extra_info.update(
        world_size=2, rows_per_rank=ROWS_PER_RANK, dim=DIM, fwd=fwd or "fp32", bwd=bwd or "fp32",
        impl="torch" if fwd is None else "recxla", wire_bytes_per_rank=nbytes,
        bytes_ratio=nbytes / fp32_bytes, memcpy_gbps=_memcpy_gbps(fp32_bytes))
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["fp32_gbps"] = fp32_bytes / benchmark.stats.stats.median / 1e9

    # Rank 0's own rows, against the exact exchange: the right rows arrived, decoded well.
    assert out.shape == inputs["ref_out"].shape
    assert sqnr_db(inputs["ref_out"], out, all_ranks=False) >= MIN_SQNR_DB[fwd or "fp32"]
    if backward:
        assert sqnr_db(inputs["ref_grad"], gx, all_ranks=False) >= MIN_SQNR_DB[bwd or "fp32"]
    if fwd in ("e4m3", "e5m2"):  # forward rows: D codes + one fp32 scale, vs 4 D bytes
        fwd_ratio = wire_bytes(inputs, DIM, False, fwd, None) / wire_bytes(inputs, DIM, False,
                                                                            None, None)
        assert fwd_ratio == (DIM + 4) / (4 * DIM)
