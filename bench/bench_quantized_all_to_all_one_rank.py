"""pytest-benchmark: a rank's exchange with itself, in a group of one rank (a job without
communication: a one-rank run of the trainer, a single-GPU user of the sharded module).

    .venv/bin/python -m pytest bench/bench_quantized_all_to_all_one_rank.py --benchmark-only

The rows a rank sends itself never leave the process, so `recxla.quantized_all_to_all` copies
them into place exactly instead of encoding them. Providers, each forward (e4m3) and backward
(e5m2) of the trainer's one-rank exchange (batch 1024 x 26 tables, dim 64):
- recxla: the op, autograd included;
- codec: what every row cost before it skipped them, and what a codec that encodes the whole
  buffer costs (TorchRec's qcomm codecs do): encode, all_to_all_single to itself, decode, both
  directions (the bare ops, no autograd);
- memcpy: a copy of the same fp32 rows, both directions.
extra_info as bench/common.py: bytes = 2 x the fp32 rows (read, written) per direction.
"""

import socket

import pytest
import torch
import torch.distributed as dist

import recxla
from bench.common import run_and_record
from recxla.ops.fp8_rows import empty_buffer

ROWS, DIM, FWD, BWD = 1024 * 26, 64, "e4m3", "e5m2"


@pytest.fixture(scope="module")
def one_rank():
    """A process group of this process alone; rows and gradients of the exchange."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    gen = torch.Generator().manual_seed(0)
    try:
        yield torch.randn(ROWS, DIM, generator=gen), torch.randn(ROWS, DIM, generator=gen)
    finally:
        dist.destroy_process_group()


def _recxla(x, g):
    x = x.detach().requires_grad_(True)
    y = recxla.quantized_all_to_all(x, [ROWS], [ROWS], fwd=FWD, bwd=BWD, validate_splits=False)
    y.backward(g)
    return y, x.grad


def _codec(x, g):
    out = []
    for rows, fmt in ((x, FWD), (g, BWD)):
        send = recxla.quantize_rows(rows, fmt)
        recv = empty_buffer(send.shape, torch.uint8, rows.device)
        dist.all_to_all_single(recv, send, [ROWS], [ROWS])
        out.append(recxla.dequantize_rows(recv, DIM, fmt))
    return out


def _memcpy(x, g, into):
    into[0].copy_(x)
    into[1].copy_(g)
    return into


@pytest.mark.parametrize("provider", ["recxla", "codec", "memcpy"])
def test_self_exchange_one_rank(benchmark, one_rank, provider):
    x, g = one_rank
    benchmark.group = f"quantized_all_to_all one rank, {ROWS} x {DIM}, fwd {FWD} + bwd {BWD}"
    fn = {"recxla": _recxla, "codec": _codec,
          "memcpy": lambda x, g: _memcpy(x, g, (torch.empty_like(x), torch.empty_like(g)))}
    fn[provider](x, g)  # the reusable buffers of the first call, out of the timing
    y, gx = run_and_record(benchmark, fn[provider], x, g, nbytes=2 * 2 * x.numel() * 4,
                           memcpy_nbytes=2 * x.numel() * 4, provider=provider, rows=ROWS, dim=DIM)
    if provider == "recxla":  # nothing travels, so nothing is lost: the rows and gradient exact
        assert torch.equal(y, x) and torch.equal(gx, g)
    elif provider == "codec":  # the codec's rounding, within FP8's relative step
        assert torch.allclose(y, x, rtol=0.07, atol=x.abs().max().item() / 448)
