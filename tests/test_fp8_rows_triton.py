"""FP8 row codec on the GPU paths: the Triton kernels against the PyTorch reference in Triton's
interpreter on CPU tensors (no GPU needed), their lowering to PTX (no GPU needed either), and, with
a GPU (`make gpu-campaign`), the CUDA and Triton kernels on CUDA tensors.
"""

import pytest
import torch

import recxla
from fp8_rows_cases import (
    DTYPES, FP8, SHAPES, assert_same_values, fp8_grid, random_rows, with_specials,
)
from recxla.formats import FORMATS
from recxla.reference.fp8_rows import dequantize_rows_ref, quantize_rows_ref

# numpy, which runs the interpreter, warns on Inf results (the kernels form them on purpose).
interpreter_warnings = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def triton_interpreted():
    pytest.importorskip("triton")
    from recxla.triton_kernels import interpreted

    return interpreted("fp8_rows")


# (rows, dim, block_d): one column block, several (block_d forced small), empty shapes.
TRITON_SHAPES = [(0, 5, None), (4, 0, None), (7, 1, None), (9, 37, None), (6, 37, 16), (5, 130, 64)]


@interpreter_warnings
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FP8)
def test_triton_interpreted_quantize(triton_interpreted, fmt, dtype):
    for rows, dim, block_d in TRITON_SHAPES:
        x = with_specials(random_rows(rows, dim, dtype))
        packed = triton_interpreted.quantize_fp8_rows_triton(x, fmt, block_d=block_d)
        assert torch.equal(packed, quantize_rows_ref(x, fmt)), (rows, dim, block_d)
    strided = random_rows(12, 50, dtype)[::2, 3:40]
    assert torch.equal(triton_interpreted.quantize_fp8_rows_triton(strided, fmt),
                       quantize_rows_ref(strided.contiguous(), fmt))


@interpreter_warnings
@pytest.mark.parametrize("fmt", FP8)
def test_triton_interpreted_rounding_cases(triton_interpreted, fmt):
    # Ties and carries into the next exponent: where the interpreter's own fp8 cast goes wrong.
    f = FORMATS[fmt]
    grid = fp8_grid(fmt)
    dim = 127
    grid = torch.cat([grid, torch.zeros((-grid.numel()) % (dim - 1))]).view(-1, dim - 1)
    x = torch.cat([torch.full((grid.shape[0], 1), f.fp8_max), grid], dim=1)
    packed = triton_interpreted.quantize_fp8_rows_triton(x, fmt)
    assert torch.equal(packed[:, :dim], x.to(f.wire_dtype).view(torch.uint8))


@interpreter_warnings
@pytest.mark.parametrize("fmt", FP8)
def test_triton_interpreted_dequantize(triton_interpreted, fmt):
    for rows, dim, block_d in TRITON_SHAPES:
        packed = quantize_rows_ref(random_rows(rows, dim), fmt)
        packed[:, :dim] = torch.randint(0, 256, (rows, dim), dtype=torch.uint8)
        for dtype in DTYPES:
            y = triton_interpreted.dequantize_fp8_rows_triton(
                packed, dim, fmt, dtype, block_d=block_d)
            assert_same_values(y, dequantize_rows_ref(packed, dim, fmt, dtype))


def test_triton_launcher_errors(triton_interpreted):
    tk = triton_interpreted
    with pytest.raises(ValueError, match=r"quantize_fp8_rows_triton: "
                       r"fmt must be 'e4m3' or 'e5m2', got 'bf16'"):
        tk.quantize_fp8_rows_triton(torch.randn(2, 3), "bf16")
    with pytest.raises(ValueError, match=r"quantize_fp8_rows_triton: x must be 2-D"):
        tk.quantize_fp8_rows_triton(torch.randn(3), "e4m3")
    with pytest.raises(
            TypeError, match=r"quantize_fp8_rows_triton: x must be float32, bfloat16 or float16"):
        tk.quantize_fp8_rows_triton(torch.ones(2, 3, dtype=torch.int64), "e4m3")
    with pytest.raises(ValueError, match=r"dequantize_fp8_rows_triton: "
                       r"packed has 7 bytes per row, but dim=4 needs 8"):
        tk.dequantize_fp8_rows_triton(torch.zeros(2, 7, dtype=torch.uint8), 4, "e4m3")


def test_triton_kernels_compile_for_gpu_without_one():
    """The kernels lower to PTX for sm_90 on this machine (no GPU needed), with IEEE division,
    no fused multiply-add and no flush-to-zero: the arithmetic the bit-exactness relies on."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from recxla.triton_kernels import fp8_rows as tk

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton install has no NVIDIA backend")
    pointers = {"x_ptr": "*bf16", "out_ptr": "*u8", "in_ptr": "*u8", "y_ptr": "*fp16"}
    cases = [
        (tk._quantize_kernel, dict(BLOCK_ROWS=4, BLOCK_D=64, ONE_BLOCK=False, **tk._FORMATS["e4m3"],
                                   IN_BF16=True)),
        (tk._quantize_kernel, dict(BLOCK_ROWS=32, BLOCK_D=128, ONE_BLOCK=True,
                                   **tk._FORMATS["e5m2"], IN_BF16=False)),
        (tk._dequantize_kernel, dict(BLOCK_ROWS=4, BLOCK_D=64, MANT=2, BIAS=15,
                                     SUBNORMAL_STEP=2.0 ** -16, OUT_BF16=False)),
        (tk._dequantize_kernel, dict(BLOCK_ROWS=4, BLOCK_D=64, MANT=3, BIAS=7,
                                     SUBNORMAL_STEP=2.0 ** -9, OUT_BF16=True)),
    ]
    for kernel, constexprs in cases:
        pointers["x_ptr"] = "*bf16" if constexprs.get("IN_BF16") else "*fp32"
        pointers["y_ptr"] = "*bf16" if constexprs.get("OUT_BF16") else "*fp16"
        signature = {name: pointers.get(name, "i64" if "stride" in name else "i32")
                     for name in kernel.arg_names if name not in constexprs}
        signature.update({name: "constexpr" for name in constexprs})
        compiled = triton.compile(ASTSource(kernel, signature, constexprs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        assert "fma." not in ptx and ".ftz" not in ptx
        if kernel is tk._quantize_kernel:
            assert ptx.count("div.rn.f32") >= 2
            assert "div.full" not in ptx and "div.approx" not in ptx


# ---------------------------------------------------------------- GPU (make gpu-campaign)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FP8)
def test_gpu_backends_match_reference(monkeypatch, backend, fmt, dtype):
    if backend == "cuda" and not recxla.built_with_cuda():
        pytest.skip("this build has no CUDA kernels")
    monkeypatch.setenv("RECXLA_BACKEND", backend)
    for rows, dim in SHAPES + [(4096, 128), (3, 5000)]:
        x = with_specials(random_rows(rows, dim, dtype))
        packed = recxla.quantize_rows(x.cuda(), fmt)
        assert packed.is_cuda
        assert torch.equal(packed.cpu(), quantize_rows_ref(x, fmt)), (rows, dim)
        packed_cpu = quantize_rows_ref(x, fmt)
        packed_cpu[:, :dim] = torch.randint(0, 256, (rows, dim), dtype=torch.uint8)
        for out_dtype in DTYPES:
            y = recxla.dequantize_rows(packed_cpu.cuda(), dim, fmt, out_dtype)
            assert_same_values(y.cpu(), dequantize_rows_ref(packed_cpu, dim, fmt, out_dtype))
    strided = random_rows(64, 300, dtype).cuda()[::2, 5:200]
    assert torch.equal(recxla.quantize_rows(strided, fmt).cpu(),
                       quantize_rows_ref(strided.cpu().contiguous(), fmt))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP8)
def test_gpu_rounding_cases(fmt):
    f = FORMATS[fmt]
    grid = fp8_grid(fmt)
    grid = torch.cat([grid, torch.zeros((-grid.numel()) % 127)]).view(-1, 127)
    x = torch.cat([torch.full((grid.shape[0], 1), f.fp8_max), grid], dim=1)
    from recxla.triton_kernels.fp8_rows import quantize_fp8_rows_triton

    expected = x.to(f.wire_dtype).view(torch.uint8)
    assert torch.equal(quantize_fp8_rows_triton(x.cuda(), fmt)[:, :128].cpu(), expected)
    if recxla.built_with_cuda():
        packed = torch.ops.recxla.quantize_fp8_rows(x.cuda(), fmt)
        assert torch.equal(packed[:, :128].cpu(), expected)
