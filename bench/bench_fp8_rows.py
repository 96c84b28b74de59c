"""pytest-benchmark: the FP8 row codec (quantize / dequantize) against its baselines.

    .venv/bin/python -m pytest bench/bench_fp8_rows.py --benchmark-only \
        --benchmark-columns=min,median,mean,rounds --benchmark-sort=name

Input: 65536 x 128 float32 (a batch of pooled embeddings of dimension 128), Gaussian rows of
varied magnitude, e4m3. CPU providers:
- recxla: the C++ CPU kernel on all threads (AVX-512 kernels when the CPU has them);
- recxla-portable: the portable C++ kernels (RECXLA_CPU_KERNELS=portable);
- recxla-1thread: recxla on one thread;
- reference: the plain-PyTorch codec (recxla/reference/fp8_rows.py), the tests' oracle;
- fbgemm-int8 / fbgemm-bf16 / fbgemm-hfp8: FBGEMM's CPU codecs (fbgemm-gpu-cpu) that TorchRec's
  QComms can use on CPU: INT8 row-wise with fp32 scale and bias (D + 8 bytes a row), bf16, and
  HFP8 (FP8 e4m3-like codes without any scale). Its FP8 row-wise codec has no CPU kernel;
- memcpy: `copy_` of the float32 input's bytes into an existing buffer; memcpy-1thread: the same
  on one thread (the baseline of recxla-1thread); memcpy+alloc: `clone`.
Bandwidth = bytes read + bytes written (bench/common.py); the reference's temporaries are not
counted. extra_info also holds wire_bytes (the encoded size) and of_memcpy. The `gpu` cases time
the CUDA and Triton kernels on a GPU (`make gpu-check`).
"""

import pytest
import torch

import recxla
from bench.common import memcpy_fn, run_and_record, tensor_bytes
from recxla.reference.fp8_rows import dequantize_rows_ref, quantize_rows_ref

ROWS, DIM, FMT = 65536, 128, "e4m3"
SEED = 0

try:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    HAVE_FBGEMM = hasattr(torch.ops.fbgemm, "FloatToFused8BitRowwiseQuantized")
except Exception:  # noqa: BLE001  (a CUDA build of FBGEMM fails to import without a driver)
    HAVE_FBGEMM = False

# HFP8 with 4 exponent bits, bias 7 and saturation at 448: e4m3's range, no per-row scale.
HFP8_ARGS = (4, 7)
HFP8_MAX = 448.0


def make_input(device="cpu"):
    g = torch.Generator().manual_seed(SEED)
    magnitude = torch.exp(torch.randn(ROWS, 1, generator=g) * 2)
    return (torch.randn(ROWS, DIM, generator=g) * magnitude).to(device)


@pytest.fixture(scope="module")
def x():
    return make_input()


@pytest.fixture
def portable_kernels(monkeypatch):
    monkeypatch.setenv("RECXLA_CPU_KERNELS", "portable")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def quantizers():
    """provider -> (fixtures to use, quantize function of x)."""
    out = {
        "recxla": ((), lambda x: recxla.quantize_rows(x, FMT)),
        "recxla-portable": (("portable_kernels",), lambda x: recxla.quantize_rows(x, FMT)),
        "recxla-1thread": (("one_thread",), lambda x: recxla.quantize_rows(x, FMT)),
        "reference": ((), lambda x: quantize_rows_ref(x, FMT)),
    }
    if HAVE_FBGEMM:
        out["fbgemm-int8"] = ((), torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized)
        out["fbgemm-bf16"] = ((), torch.ops.fbgemm.FloatToBfloat16Quantized)
        out["fbgemm-hfp8"] = (
            (), lambda x: torch.ops.fbgemm.FloatToHFP8Quantized(x, *HFP8_ARGS, HFP8_MAX))
    return out


def dequantizers():
    """provider -> (fixtures to use, quantize function of x, dequantize function of its output)."""
    ours = lambda q: recxla.dequantize_rows(q, DIM, FMT)  # noqa: E731
    out = {
        "recxla": ((), quantizers()["recxla"][1], ours),
        "recxla-portable": (("portable_kernels",), quantizers()["recxla"][1], ours),
        "recxla-1thread": (("one_thread",), quantizers()["recxla"][1], ours),
        "reference": ((), quantizers()["recxla"][1], lambda q: dequantize_rows_ref(q, DIM, FMT)),
    }
    if HAVE_FBGEMM:
        fb = torch.ops.fbgemm
        out["fbgemm-int8"] = (
            (), fb.FloatToFused8BitRowwiseQuantized, fb.Fused8BitRowwiseQuantizedToFloat)
        out["fbgemm-bf16"] = ((), fb.FloatToBfloat16Quantized, fb.Bfloat16QuantizedToFloat)
        out["fbgemm-hfp8"] = (
            (), quantizers()["fbgemm-hfp8"][1], lambda q: fb.HFP8QuantizedToFloat(q, *HFP8_ARGS))
    return out


MEMCPY = ["memcpy", "memcpy-1thread", "memcpy+alloc"]


def memcpy_provider(benchmark, request, provider, nbytes):
    if provider == "memcpy-1thread":
        request.getfixturevalue("one_thread")
    copy = memcpy_fn(nbytes, alloc=provider == "memcpy+alloc")
    run_and_record(benchmark, copy, nbytes=2 * nbytes, memcpy_nbytes=nbytes)


@pytest.mark.parametrize("provider", list(quantizers()) + MEMCPY)
def test_quantize(benchmark, request, x, provider):
    benchmark.group = f"quantize {ROWS}x{DIM} float32 -> {FMT}"
    input_bytes = tensor_bytes(x)
    if provider in MEMCPY:
        return memcpy_provider(benchmark, request, provider, input_bytes)
    fixtures, quantize = quantizers()[provider]
    for name in fixtures:
        request.getfixturevalue(name)
    wire_bytes = tensor_bytes(quantize(x))
    out = run_and_record(benchmark, quantize, x, nbytes=input_bytes + wire_bytes,
                         memcpy_nbytes=input_bytes, wire_bytes=wire_bytes)
    if provider.startswith("recxla"):  # what was timed is the codec
        assert torch.equal(out[:1024], quantize_rows_ref(x[:1024], FMT))


@pytest.mark.parametrize("provider", list(dequantizers()) + MEMCPY)
def test_dequantize(benchmark, request, x, provider):
    benchmark.group = f"dequantize {FMT} -> {ROWS}x{DIM} float32"
    output_bytes = tensor_bytes(x)
    if provider in MEMCPY:
        return memcpy_provider(benchmark, request, provider, output_bytes)
    fixtures, quantize, dequantize = dequantizers()[provider]
    for name in fixtures:
        request.getfixturevalue(name)
    packed = quantize(x)
    y = run_and_record(benchmark, dequantize, packed, nbytes=tensor_bytes(packed) + output_bytes,
                       memcpy_nbytes=output_bytes, wire_bytes=tensor_bytes(packed))
    assert y.shape == x.shape and y.dtype == torch.float32


# ---------------------------------------------------------------- GPU (make gpu-check)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", ["cuda", "triton", "reference", "memcpy"])
@pytest.mark.parametrize("op", ["quantize", "dequantize"])
def test_gpu(benchmark, monkeypatch, op, provider):
    benchmark.group = f"gpu {op} {ROWS}x{DIM} float32 <-> {FMT}"
    x = make_input("cuda")
    packed = quantize_rows_ref(x, FMT)
    if provider == "memcpy":
        run_and_record(benchmark, memcpy_fn(tensor_bytes(x), "cuda"), nbytes=2 * tensor_bytes(x),
                       memcpy_nbytes=tensor_bytes(x), device="cuda")
        return
    if provider == "cuda" and not recxla.built_with_cuda():
        pytest.skip("this build has no CUDA kernels")
    if provider != "reference":
        monkeypatch.setenv("RECXLA_BACKEND", provider)
    if op == "quantize":
        fn = quantize_rows_ref if provider == "reference" else recxla.quantize_rows
        run_and_record(benchmark, fn, x, FMT, nbytes=tensor_bytes(x, packed),
                       memcpy_nbytes=tensor_bytes(x), device="cuda")
    else:
        fn = dequantize_rows_ref if provider == "reference" else recxla.dequantize_rows
        run_and_record(benchmark, fn, packed, DIM, FMT, nbytes=tensor_bytes(x, packed),
                       memcpy_nbytes=tensor_bytes(x), device="cuda")
