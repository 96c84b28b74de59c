"""pytest-benchmark: recxla.quantized_all_to_all on 2 gloo ranks over loopback.

This process is rank 0 and the timer; rank 1 runs in a process started by the cluster harness
(`EmulatedCluster.start_peers`) and follows rank 0's commands: before each round (untimed),
rank 0 broadcasts which case to run next, then both run it. The cases, inputs and bytes come
from bench/cluster/run_a2a.py, which runs the same exchange across emulated nodes with shaped
links (`make bench-cluster`); this file is the quick loopback view for `make bench`.

    .venv/bin/python -m pytest bench/bench_quantized_all_to_all.py --benchmark-only

extra_info per case: wire_bytes_per_rank (bytes sent to the other rank per step), bytes_ratio
(to plain fp32 all_to_all_single), and bench/common.py's bytes, gbps, memcpy_gbps, of_memcpy
with bytes = 2 x the fp32 rows exchanged (read on one rank, written on the other): the exchange
against a local memcpy of the same rows.
"""

import pytest
import torch

from bench.cluster import EmulatedCluster
from bench.cluster.run_a2a import VARIANTS, make_inputs, make_step, sqnr_db, wire_bytes
from bench.common import gbps, memcpy_gbps

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

    # The allocator setting that bench/conftest.py gives rank 0 (it applies it on import): both
    # ranks then pay the same for the fresh buffers of every step.
    import bench.conftest  # noqa: F401

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
    # As bench/common.py counts a memcpy: the fp32 rows exchanged are read on one rank and
    # written on the other, 2 x their bytes, whatever format they travel in.
    moved = 2 * fp32_bytes
    reference = memcpy_gbps(fp32_bytes)
    benchmark.extra_info.update(
        world_size=2, rows_per_rank=ROWS_PER_RANK, dim=DIM, fwd=fwd or "fp32", bwd=bwd or "fp32",
        impl="torch" if fwd is None else "recxla", wire_bytes_per_rank=nbytes,
        bytes_ratio=nbytes / fp32_bytes, bytes=moved, memcpy_gbps=round(reference, 2))
    if benchmark.stats is not None:  # None under --benchmark-disable
        speed = gbps(moved, benchmark.stats.stats.median)
        benchmark.extra_info.update(gbps=round(speed, 2), of_memcpy=round(speed / reference, 3))

    # Rank 0's own rows, against the exact exchange: the right rows arrived, decoded well.
    assert out.shape == inputs["ref_out"].shape
    assert sqnr_db(inputs["ref_out"], out, all_ranks=False) >= MIN_SQNR_DB[fwd or "fp32"]
    if backward:
        assert sqnr_db(inputs["ref_grad"], gx, all_ranks=False) >= MIN_SQNR_DB[bwd or "fp32"]
    if fwd in ("e4m3", "e5m2"):  # forward rows: D codes + one fp32 scale, vs 4 D bytes
        fwd_ratio = wire_bytes(inputs, DIM, False, fwd, None) / wire_bytes(inputs, DIM, False,
                                                                            None, None)
        assert fwd_ratio == (DIM + 4) / (4 * DIM)
