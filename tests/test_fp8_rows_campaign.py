"""The GPU campaign's FP8 row codec module (bench/gpu_campaign/fp8_rows.py) on CPU: its dry run
takes the code path of the GPU run (the C++ CPU op stands in for every CUDA variant, Triton runs
interpreted), and its check catches a kernel that leaves bytes unwritten or writes wrong ones."""

import contextlib

import pytest
import torch

from bench.gpu_campaign import fp8_rows as campaign
from bench.gpu_campaign.timing import DEVICE_COPY
from recxla.ops.gpu_variants import variants

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def test_dry_run_rows_and_choices():
    result = campaign.run("cpu", dry_run=True)
    rows = result["rows"]
    assert not [r for r in rows if r["check"].startswith("FAILED")], rows
    for op, family in campaign.FAMILIES.items():
        for n, dim, dtype, fmt, _ in campaign.DRY_TIMED:
            group = campaign._group(op, n, dim, dtype, fmt)
            mine = {r["provider"]: r for r in rows if r["group"] == group}
            expected = {f"cuda:{v}" for v in variants(family)} | {
                "triton", campaign.PLAIN, DEVICE_COPY}
            assert set(mine) == expected, (group, sorted(mine))
            for name, r in mine.items():
                assert r["median_us"] > 0 and r["bytes"] == n * dim * 4 + n * (dim + 4)
                assert r["check"] == ("exact" if name.startswith(("cuda:", "triton")) else
                                      "baseline" if name == DEVICE_COPY else r["check"])
            assert mine[campaign.PLAIN]["check"].startswith("close")
            assert all("of_copy" in r and r["back_to_back_us"] > 0 for r in mine.values())
    families = {c["family"]: c for c in result["choices"]}
    assert set(families) == set(campaign.FAMILIES.values())
    for family, choice in families.items():
        assert choice["winner"] in variants(family) and choice["capability"] == 0
        assert choice["why"].startswith("dry run on CPU")


def _broken(kind):
    """A quantize / dequantize that gets the last row's first element wrong: left unwritten
    (as the poison left it), or one bit off."""
    def finish(out, full):
        keep = out[-1, 0].clone()
        out.copy_(full)
        if kind == "unwritten":
            out[-1, 0] = keep
        else:
            out.view(torch.uint8)[-1, 0] ^= 1

    def quantize(x, fmt, out):
        if out.numel():
            finish(out, torch.ops.recxla.quantize_fp8_rows(x, fmt))

    def dequantize(packed, dim, fmt, y):
        if y.numel():
            finish(y, torch.ops.recxla.dequantize_fp8_rows(packed, dim, fmt, y.dtype))

    return quantize, dequantize, lambda op: contextlib.nullcontext()


@pytest.mark.parametrize("kind", ["unwritten", "wrong"])
def test_check_catches_a_broken_kernel(kind):
    cases = campaign.check_cases(campaign.DRY_TIMED)
    fns = _broken(kind)
    assert campaign.check("quantize", fns, fns[2], cases, "cpu").startswith("FAILED: quantize")
    assert campaign.check("dequantize", fns, fns[2], cases, "cpu").startswith(
        "FAILED: dequantize")
    good = campaign._providers("cpu")["cuda:warp_per_row"]
    assert campaign.check("quantize", good, good[2], cases, "cpu") == "exact"
