"""pytest-benchmark: the FP8 row codec (quantize / dequantize) against what a user runs instead.

One command runs everything twice, with the default allocator and with the tuned one (freed
memory kept in the process, bench/conftest.py), and prints the tables of bench/results/fp8_rows.md:

    .venv/bin/python bench/bench_fp8_rows.py            # both runs, then the tables
    .venv/bin/python -m pytest bench/bench_fp8_rows.py --benchmark-only   # one run, raw

Input: 65536 x 128 float32 (a batch of pooled embeddings of dimension 128; 32 MiB), Gaussian rows
of log-normal magnitudes, format e4m3. Providers, each at 1 and 2 threads unless noted:
- plain: plain PyTorch in fp32 as a user writes it (`plain_quantize` / `plain_dequantize`
  below): per-row amax, 448 / amax, clamp, `.to(torch.float8_e4m3fn)`; the reverse multiplies
  the codes by the row's scale. It returns codes and scales as two tensors: no packing into one
  wire buffer, which favours it;
- compiled: the same two functions under `torch.compile` (Inductor: a fused C++/OpenMP kernel),
  compiled at the thread count it runs with (Inductor drops the OpenMP loop when compiling on 1);
- recxla: `recxla.quantize_rows` / `dequantize_rows` as a user calls them (a fresh result each
  call, which comes from recxla's reusable buffers); recxla-out: the same into `out=`;
- fbgemm-int8 / fbgemm-bf16 / fbgemm-hfp8 (1 thread only: FBGEMM's CPU codecs are
  single-threaded): the codecs of fbgemm-gpu-cpu that TorchRec's QComms can use on CPU (its FP8
  row-wise codec has no CPU kernel). INT8 row-wise has an fp32 scale and bias per row, HFP8 no
  scale at all;
- memcpy: `copy_` of the 32 MiB fp32 tensor into an existing one; memcpy+alloc: `clone`.
The PyTorch reference of the tests (fp64, bit-exact) is an oracle, not a provider. Bandwidth =
bytes read + written (bench/common.py); extra_info holds threads, wire_bytes, of_memcpy (against
the memcpy on the same thread count). The `gpu` cases time the CUDA and Triton kernels on a GPU
(`python -m pytest bench -m gpu --benchmark-only`).
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

# Run as a script (`python bench/bench_fp8_rows.py`), the repository root is not on sys.path.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import recxla  # noqa: E402
from bench.common import memcpy_fn, run_and_record, tensor_bytes  # noqa: E402
from recxla.reference.fp8_rows import quantize_rows_ref  # noqa: E402

ROWS, DIM, FMT = 65536, 128, "e4m3"
FP8_MAX = 448.0
SEED = 0
THREADS = [1, 2]

try:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    HAVE_FBGEMM = hasattr(torch.ops.fbgemm, "FloatToFused8BitRowwiseQuantized")
except Exception:  # noqa: BLE001  (a CUDA build of FBGEMM fails to import without a driver)
    HAVE_FBGEMM = False

# HFP8 with 4 exponent bits, bias 7 and saturation at 448: e4m3's range, no per-row scale.
HFP8_ARGS = (4, 7)


def plain_quantize(x: torch.Tensor):
    """[N, D] float32 -> (codes float8_e4m3fn [N, D], scale float32 [N, 1]), the obvious way."""
    amax = x.abs().amax(dim=1, keepdim=True)
    inv_scale = FP8_MAX / amax
    codes = (x * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, 1.0 / inv_scale


def plain_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(codes float8_e4m3fn [N, D], scale float32 [N, 1]) -> [N, D] float32."""
    return codes.to(torch.float32) * scale


def make_input(device="cpu"):
    g = torch.Generator().manual_seed(SEED)
    magnitude = torch.exp(torch.randn(ROWS, 1, generator=g) * 2)
    return (torch.randn(ROWS, DIM, generator=g) * magnitude).to(device)


@pytest.fixture(scope="module")
def x():
    return make_input()


@pytest.fixture(params=THREADS, ids=lambda t: f"{t}thread")
def threads(request):
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


_compiled = {}


def compiled_peers(threads: int):
    """(quantize, dequantize) under torch.compile, compiled at `threads` threads and warmed up."""
    if _compiled.get("threads") != threads:
        torch.compiler.reset()
        x = make_input()
        q, dq = torch.compile(plain_quantize), torch.compile(plain_dequantize)
        for _ in range(2):
            dq(*q(x))
        _compiled.update(threads=threads, fns=(q, dq))
    return _compiled["fns"]


def quantizer(provider: str, threads: int, x: torch.Tensor):
    """A function of x doing provider's quantize."""
    if provider == "plain":
        return plain_quantize
    if provider == "compiled":
        return compiled_peers(threads)[0]
    if provider == "recxla":
        return lambda t: recxla.quantize_rows(t, FMT)
    if provider == "recxla-out":
        out = torch.empty(ROWS, recxla.row_bytes(DIM, FMT), dtype=torch.uint8)
        return lambda t: recxla.quantize_rows(t, FMT, out=out)
    fb = torch.ops.fbgemm
    return {"fbgemm-int8": fb.FloatToFused8BitRowwiseQuantized,
            "fbgemm-bf16": fb.FloatToBfloat16Quantized,
            "fbgemm-hfp8": lambda t: fb.FloatToHFP8Quantized(t, *HFP8_ARGS, FP8_MAX)}[provider]


def dequantizer(provider: str, threads: int, x: torch.Tensor):
    """(wire data of x, a function of it doing provider's dequantize)."""
    if provider in ("plain", "compiled"):
        q = plain_quantize if provider == "plain" else compiled_peers(threads)[0]
        dq = plain_dequantize if provider == "plain" else compiled_peers(threads)[1]
        return q(x), lambda wire: dq(*wire)
    if provider == "recxla":
        return recxla.quantize_rows(x, FMT), lambda p: recxla.dequantize_rows(p, DIM, FMT)
    if provider == "recxla-out":
        out = torch.empty(ROWS, DIM)
        return recxla.quantize_rows(x, FMT), lambda p: recxla.dequantize_rows(p, DIM, FMT,
                                                                               out=out)
    fb = torch.ops.fbgemm
    if provider == "fbgemm-int8":
        return fb.FloatToFused8BitRowwiseQuantized(x), fb.Fused8BitRowwiseQuantizedToFloat
    if provider == "fbgemm-bf16":
        return fb.FloatToBfloat16Quantized(x), fb.Bfloat16QuantizedToFloat
    return (fb.FloatToHFP8Quantized(x, *HFP8_ARGS, FP8_MAX),
            lambda q: fb.HFP8QuantizedToFloat(q, *HFP8_ARGS))


FBGEMM = ["fbgemm-int8", "fbgemm-bf16", "fbgemm-hfp8"] if HAVE_FBGEMM else []
CODECS = ["plain", "compiled", "recxla", "recxla-out"] + FBGEMM
MEMCPY = ["memcpy", "memcpy+alloc"]


def skip_unless_thread_matched(provider: str, threads: int) -> None:
    if provider.startswith("fbgemm") and threads != 1:
        pytest.skip("FBGEMM's CPU codecs are single-threaded: compared at 1 thread only")


def wire_bytes(wire) -> int:
    return sum(tensor_bytes(t) for t in wire) if isinstance(wire, tuple) else tensor_bytes(wire)


def check_round_trip(x: torch.Tensor, y: torch.Tensor) -> None:
    """What was timed decodes to x within e4m3's rounding: 3 mantissa bits, about 31 dB on
    these rows (recxla's and the plain codec's codes agree but for rare 1-ulp scale
    differences)."""
    err = (y[:4096].double() - x[:4096].double()).pow(2).sum()
    sqnr_db = 10 * torch.log10(x[:4096].double().pow(2).sum() / err)
    assert sqnr_db > 29.0, sqnr_db


@pytest.mark.parametrize("provider", CODECS + MEMCPY)
def test_quantize(benchmark, x, threads, provider):
    skip_unless_thread_matched(provider, threads)
    benchmark.group = f"quantize {ROWS}x{DIM} float32 -> {FMT}, {threads} thread(s)"
    benchmark.extra_info["threads"] = threads
    input_bytes = tensor_bytes(x)
    if provider in MEMCPY:
        copy = memcpy_fn(input_bytes, alloc=provider == "memcpy+alloc")
        run_and_record(benchmark, copy, nbytes=2 * input_bytes, memcpy_nbytes=input_bytes)
        return
    quantize = quantizer(provider, threads, x)
    wire = quantize(x)
    nbytes = wire_bytes(wire)
    wire = run_and_record(benchmark, quantize, x, nbytes=input_bytes + nbytes,
                          memcpy_nbytes=input_bytes, wire_bytes=nbytes)
    if provider.startswith("recxla"):  # what was timed is the codec, bit for bit
        assert torch.equal(wire[:1024], quantize_rows_ref(x[:1024], FMT))
    elif provider in ("plain", "compiled"):
        check_round_trip(x, plain_dequantize(*wire))


@pytest.mark.parametrize("provider", CODECS + MEMCPY)
def test_dequantize(benchmark, x, threads, provider):
    skip_unless_thread_matched(provider, threads)
    benchmark.group = f"dequantize {FMT} -> {ROWS}x{DIM} float32, {threads} thread(s)"
    benchmark.extra_info["threads"] = threads
    output_bytes = tensor_bytes(x)
    if provider in MEMCPY:
        copy = memcpy_fn(output_bytes, alloc=provider == "memcpy+alloc")
        run_and_record(benchmark, copy, nbytes=2 * output_bytes, memcpy_nbytes=output_bytes)
        return
    wire, dequantize = dequantizer(provider, threads, x)
    nbytes = wire_bytes(wire)
    y = run_and_record(benchmark, dequantize, wire, nbytes=nbytes + output_bytes,
                       memcpy_nbytes=output_bytes, wire_bytes=nbytes)
    assert y.shape == x.shape and y.dtype == torch.float32
    if not provider.startswith("fbgemm"):
        check_round_trip(x, y)


# ---------------------------------------------------------------- GPU (pytest bench -m gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", ["cuda", "triton", "compiled", "memcpy"])
@pytest.mark.parametrize("op", ["quantize", "dequantize"])
def test_gpu(benchmark, monkeypatch, op, provider):
    benchmark.group = f"gpu {op} {ROWS}x{DIM} float32 <-> {FMT}"
    x = make_input("cuda")
    packed = quantize_rows_ref(x, FMT)
    if provider == "memcpy":
        run_and_record(benchmark, memcpy_fn(tensor_bytes(x), "cuda"), nbytes=2 * tensor_bytes(x),
                       memcpy_nbytes=tensor_bytes(x), device="cuda")
        return
    if provider == "compiled":
        q, dq = torch.compile(plain_quantize), torch.compile(plain_dequantize)
        wire = q(x)
        fn, arg = (q, x) if op == "quantize" else ((lambda w: dq(*w)), wire)
        fn(arg)
        run_and_record(benchmark, fn, arg, nbytes=tensor_bytes(x, packed),
                       memcpy_nbytes=tensor_bytes(x), device="cuda")
        return
    if provider == "cuda" and not recxla.built_with_cuda():
        pytest.skip("this build has no CUDA kernels")
    monkeypatch.setenv("RECXLA_BACKEND", provider)
    if op == "quantize":
        run_and_record(benchmark, recxla.quantize_rows, x, FMT, nbytes=tensor_bytes(x, packed),
                       memcpy_nbytes=tensor_bytes(x), device="cuda")
    else:
        run_and_record(benchmark, recxla.dequantize_rows, packed, DIM, FMT,
                       nbytes=tensor_bytes(x, packed), memcpy_nbytes=tensor_bytes(x),
                       device="cuda")


# ---------------------------------------------------------------- the two runs and their tables

ALLOCATORS = {"default": "default", "tuned": "keep"}  # column -> RECXLA_BENCH_MALLOC


def _run(allocator: str, json_path: str, extra) -> None:
    env = dict(os.environ, RECXLA_BENCH_MALLOC=ALLOCATORS[allocator])
    cmd = [sys.executable, "-m", "pytest", "-q", os.path.abspath(__file__), "--benchmark-only",
           f"--benchmark-json={json_path}", "-p", "no:cacheprovider"] + list(extra)
    subprocess.run(cmd, check=True, env=env, cwd=_ROOT)


def _load(json_path: str) -> dict:
    """{(op, provider, threads): stats dict in ms}."""
    with open(json_path) as f:
        doc = json.load(f)
    out = {}
    for b in doc["benchmarks"]:
        op = b["name"].split("[")[0].replace("test_", "")
        s = b["stats"]
        out[(op, b["params"]["provider"], b["extra_info"]["threads"])] = {
            "median": s["median"] * 1e3, "min": s["min"] * 1e3, "rounds": s["rounds"],
            "gbps": b["extra_info"].get("gbps"), "of_memcpy": b["extra_info"].get("of_memcpy")}
    return out


def print_tables(results: dict) -> None:
    """results: {allocator: _load(...)}. Medians (minimum in brackets); ratios are peer time /
    recxla time on the same thread count and allocator, from one run."""
    providers = CODECS + MEMCPY
    for op in ("quantize", "dequantize"):
        print(f"\n### {op} {ROWS}x{DIM} float32 {'->' if op == 'quantize' else '<-'} {FMT}\n")
        cols = [(a, t) for a in results for t in THREADS]
        print("| provider | " + " | ".join(f"{a}, {t} thr: median [min] ms" for a, t in cols)
              + " |")
        print("|---|" + "---:|" * len(cols))
        for p in providers:
            cells = []
            for a, t in cols:
                r = results[a].get((op, p, t))
                cells.append("" if r is None else f"{r['median']:.2f} [{r['min']:.2f}]")
            print(f"| {p} | " + " | ".join(cells) + " |")
        print()
        for a, t in cols:
            res = results[a]
            ours = res.get((op, "recxla", t))
            if ours is None:
                continue
            parts = []
            for p in ("compiled", "plain", "memcpy") + tuple(
                    f for f in FBGEMM if t == 1):
                r = res.get((op, p, t))
                if r is not None:
                    parts.append(f"{p} {r['median'] / ours['median']:.2f}x")
            print(f"- {a} allocator, {t} thread(s): recxla is faster than " + ", ".join(parts)
                  + f" (peer median / recxla median); recxla at {ours['of_memcpy']:.0%} of "
                  "memcpy GB/s")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with tempfile.TemporaryDirectory(prefix="fp8_bench_") as tmp:
        results = {}
        for allocator in ALLOCATORS:
            path = os.path.join(tmp, f"{allocator}.json")
            _run(allocator, path, argv)
            results[allocator] = _load(path)
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    print(f"\nmachine: {cpu}, {os.cpu_count()} cores; load average {os.getloadavg()}")
    print_tables(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
