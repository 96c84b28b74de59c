"""Inputs and checks shared by the FP8 row codec tests (test_fp8_rows.py and
test_fp8_rows_triton.py)."""

import torch

from recxla.formats import FORMATS

FP8 = ["e4m3", "e5m2"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, dim): empty, single, D not a multiple of 4 / 16 / 64, several column blocks.
SHAPES = [(0, 7), (6, 0), (1, 1), (33, 3), (9, 16), (5, 17), (17, 64), (4, 100), (7, 129), (3, 300)]


def random_rows(rows, dim, dtype=torch.float32, device="cpu"):
    """Gaussian rows whose magnitudes span 1e-30 .. 1e4 (fp32 subnormal products, bf16/fp16
    underflow and overflow to Inf included once cast)."""
    magnitude = torch.exp(torch.empty(rows, 1).uniform_(-69.0, 9.2))
    return (torch.randn(rows, dim) * magnitude).to(dtype).to(device)


def with_specials(x):
    """x with NaN, +Inf, -Inf and an all-zero row at random places (needs >= 4 rows)."""
    x = x.clone()
    rows, dim = x.shape
    if rows >= 4 and dim >= 1:
        r = torch.randperm(rows)[:4]
        x[r[0], torch.randint(dim, ())] = float("nan")
        x[r[1], torch.randint(dim, ())] = float("inf")
        x[r[2], torch.randint(dim, ())] = -float("inf")
        x[r[3]] = 0
    return x


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_values(actual, expected):
    """Same dtype and shape, NaN at the same places, every other value bit for bit."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    assert torch.equal(bits(actual)[~nan], bits(expected)[~nan])


def fp8_grid(fmt):
    """fp32 values that probe every rounding decision of `fmt`: each FP8 magnitude, the midpoints
    between neighbours (ties to even), one fp32 ulp either side, and the fp32 subnormals below the
    smallest FP8 step; both signs. All within +-FP8_MAX."""
    f = FORMATS[fmt]
    codes = torch.arange(256, dtype=torch.uint8).view(f.wire_dtype).float()
    values = codes[torch.isfinite(codes) & (codes >= 0)].unique()
    mids = (values[1:] + values[:-1]) / 2  # exact in fp32
    near = torch.cat([values, mids])
    up = torch.nextafter(near, torch.tensor(float("inf")))
    down = torch.nextafter(near, torch.tensor(0.0))
    tiny = torch.tensor([1e-45, 1e-40, 1.1754942e-38, 1e-10])
    grid = torch.cat([near, up, down, tiny]).clamp(max=f.fp8_max)
    return torch.cat([grid, -grid])
