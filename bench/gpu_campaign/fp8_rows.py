"""Campaign stage: the FP8 row codec (families "fp8_quantize" and "fp8_dequantize").

Every variant of both families (`recxla.ops.gpu_variants.variants`), the Triton kernels, plain
PyTorch as a user writes it (`plain_quantize` / `plain_dequantize`, imported from
bench/bench_fp8_rows.py), the same functions under torch.compile, and a device copy of the bytes
the op moves, on these messages:
- 65536 x 128 float32, e4m3: the codec's benchmark shape (bench/bench_fp8_rows.py);
- 3745 x 64 float32, e4m3, and 4936 x 64 float32, e5m2: the largest messages the trainer's
  output all-to-all quantized with its defaults (`python -m recxla.train`: Criteo profile, batch
  1024 per rank, 64-wide embeddings, e4m3 forward, e5m2 backward; the gradient is float32 too)
  on 2 and 4 ranks; the row count varies from step to step with the row exchange (2761-3745 rows
  on 2 ranks, 4783-4936 on 4, seen on CPU/gloo);
- 65536 x 128 bfloat16, e4m3: the path a bfloat16 model takes (the trainer does not).

Bytes per call (read + written; a wire row is D codes + a 4-byte fp32 scale, no padding):
  65536 x 128 float32: 33,554,432 + 8,650,752 = 42,205,184 (quantize and dequantize alike)
  65536 x 128 bfloat16: 16,777,216 + 8,650,752 = 25,427,968
  3745 x 64 float32: 958,720 + 254,660 = 1,213,380;  4936 x 64: 1,263,616 + 335,648 = 1,599,264
`of_copy` is the device copy's time for those bytes over the provider's.

The variants (csrc/cuda/fp8_rows.cu, fp8_rows_vector.cuh; lane code in
csrc/include/recxla/fp8_vector.h):
- warp_per_row (the fallback): a warp per row, lanes stride over the columns with 4-byte loads,
  quantize reads the row twice (amax, then encode) and stores one byte per lane; dequantize reads
  one byte and the 4-byte scale per value. Measured before: 40.0 us quantize (0.54x of the copy),
  35.9 us dequantize (0.60x) at 65536 x 128 float32 on an H100.
- vector_warp_per_row: the row read once with 16-byte loads and kept in registers (1-8 chunks of
  16 bytes per lane, D <= 1024 float32 / 2048 16-bit), amax by 5 xor shuffles, codes stored as
  4-byte words, scale by one lane; dequantize loads 4 codes as one word and stores 16 bytes
  (float32) or 8 (16-bit). At D=64 float32 half of its lanes idle.
- vector_rows_per_warp: the same lane code with a group of G lanes per row (G a power of two
  giving each lane about two chunks: G=16 at D=128, 8 at D=64 float32), 32/G rows per warp, so
  every lane works and a row's amax takes log2(G) shuffles.
The vector variants run when D % 4 == 0 (quantize: a whole number of 16-byte chunks per row),
x, out and y are aligned (16 bytes for x and its row stride, 4 for the wire rows, 16/8 for y) and
D fits in registers; otherwise the call runs warp_per_row (recxla/fp8_vector.h, tested on CPU by
tests/test_fp8_rows_vector.py).

Check (before any timing): each variant and the Triton kernels against
recxla.reference.fp8_rows on fresh random inputs with NaN, +-Inf and an all-zero row, 13 shapes
(empty, D = 1, 3, 4, 127, 128, 132, 1024, 1028, 2048, 5000: both vector paths and every fallback)
x float32 / bfloat16 / float16 x e4m3 / e5m2, and each timed shape; outputs are poisoned with two
patterns (0x5A.., 0xA5..) so an unwritten byte fails one of them. Codes compare bit for bit;
decoded values bit for bit except NaN payloads (NaN where the reference has NaN). A provider that
fails is recorded "FAILED: ..." and neither timed nor chosen; a CUDA error (a poisoned context)
stops every later CUDA call, and the rows say so. Plain PyTorch and torch.compile are a
different codec (no finite-only amax, e4m3 always, codes and scales as two tensors): their check
is a round trip within e4m3's precision ("close").

The winner per family: the variant with the least geometric mean, over the timed shapes, of
its median over the best variant's median there; it replaces warp_per_row only when that mean
is at least 3% better (less would be noise).

Predictions, written before any GPU run (H100, sm_90; not measurements). The copy of 42.2 MB
ran at 1.92 TB/s (35 us for 67 MB), so:
- 65536 x 128 float32: copy ~22 us. vector_rows_per_warp ~24-27 us (0.82-0.92x) both ways;
  vector_warp_per_row the same at D=128 but for its 5 shuffles per row (~25-28 us);
  warp_per_row ~40 / ~36 us as before. Triton ~26-35 us; torch.compile ~30-45 us (two passes or a
  fused reduction and a cast); plain PyTorch ~150-250 us (6+ kernels, several passes).
- 65536 x 128 bfloat16: copy ~13 us; vector ~15-17 us (0.8-0.9x).
- the trainer's 1.2-1.6 MB messages: latency, not bandwidth: copy ~2.5-3.5 us, the vector
  variants ~3-4.5 us (0.7-0.95x; one wave of ~235 blocks, one DRAM round trip per row),
  vector_rows_per_warp ahead of vector_warp_per_row (half of whose lanes idle at D=64),
  warp_per_row ~4-6 us.
- The module's whole GPU run: ~15-30 s, most of it torch.compile.
"""

import contextlib
import math
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from bench.bench_fp8_rows import plain_dequantize, plain_quantize
from bench.gpu_campaign.timing import (
    DEVICE_COPY, Guard, choice, copy_fn, failed_row, rotation_count, row, time_calls,
)
from recxla.reference.fp8_rows import dequantize_rows_ref, quantize_rows_ref

FAMILIES = {"quantize": "fp8_quantize", "dequantize": "fp8_dequantize"}
FORMATS = ("e4m3", "e5m2")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# (rows, dim) of the checks: empty, odd D (fallback), one chunk, the vector shapes, a row wider
# than the registers hold (fallback), and rows past one grid-stride step.
CHECK_SHAPES = [(0, 64), (5, 0), (1, 1), (33, 3), (37, 127), (70, 4), (64, 64), (129, 128),
                (9, 1024), (7, 1028), (5, 2048), (65, 132), (3, 5000)]
# (rows, dim, dtype, fmt, what it is); the dry run uses small stand-ins.
TIMED = [(65536, 128, torch.float32, "e4m3", "benchmark shape"),
         (3745, 64, torch.float32, "e4m3", "trainer forward message, 2 ranks"),
         (4936, 64, torch.float32, "e5m2", "trainer backward message, 4 ranks"),
         (65536, 128, torch.bfloat16, "e4m3", "bfloat16 input / output")]
# Triton's interpreter takes ~0.2 s per program of 32 rows: the dry run keeps to one or two.
DRY_TIMED = [(32, 128, torch.float32, "e4m3", "benchmark shape (dry run size)"),
             (37, 64, torch.float32, "e5m2", "trainer message (dry run size)")]
BUDGET_S = 40.0
COMPILE_NEEDS_S = 15.0  # torch.compile starts only while this much of the budget is left
NOISE = 1.03  # a variant must beat warp_per_row by 3% (geometric mean) to replace it
PLAIN, COMPILED = "plain PyTorch", "torch.compile(plain PyTorch)"


def random_rows(rows: int, dim: int, dtype, specials: bool = False) -> torch.Tensor:
    """CPU rows: Gaussian values times a log-normal magnitude per row; with `specials`, a NaN,
    +Inf and -Inf at random places and an all-zero row (when there are >= 4 rows)."""
    x = torch.randn(rows, dim) * torch.exp(torch.randn(rows, 1) * 2)
    if specials and rows >= 4 and dim >= 1:
        r = torch.randperm(rows)[:4]
        x[r[0], torch.randint(dim, ())] = float("nan")
        x[r[1], torch.randint(dim, ())] = float("inf")
        x[r[2], torch.randint(dim, ())] = -float("inf")
        x[r[3]] = 0
    return x.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _differs(op: str, got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    """What differs between an output and the reference (None: nothing): codes bit for bit;
    decoded values bit for bit where the reference is not NaN, NaN where it is."""
    got = got.cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    if op == "quantize":
        bad = got != want
    else:
        nan = torch.isnan(want)
        bad = (torch.isnan(got) != nan) | ((_bits(got) != _bits(want)) & ~nan)
    if not bool(bad.any()):
        return None
    r, c = (int(i) for i in torch.nonzero(bad)[0])
    return (f"{int(bad.sum())} elements differ, first [{r}, {c}]: "
            f"{got[r, c].item()!r}, want {want[r, c].item()!r}")


def _providers(device: str) -> Dict[str, Tuple[Callable, Callable, Callable]]:
    """recxla's providers: name -> (quantize(x, fmt, out), dequantize(packed, dim, fmt, y),
    context factory of (op)). The variants call the CUDA ops with the family's override (on CPU
    the C++ CPU op stands in for each); Triton runs interpreted on CPU."""
    from recxla.ops.gpu_variants import use_variant, variants

    ops = torch.ops.recxla
    out = {}
    for variant in variants(FAMILIES["quantize"]):
        out[f"cuda:{variant}"] = (
            lambda x, fmt, o: ops.quantize_fp8_rows_out(x, fmt, o),
            lambda p, dim, fmt, y: ops.dequantize_fp8_rows_out(p, dim, fmt, y),
            lambda op, v=variant: use_variant(FAMILIES[op], v))
    try:
        if device == "cpu":
            from recxla.triton_kernels import interpreted

            tk = interpreted("fp8_rows")
        else:
            from recxla.triton_kernels import fp8_rows as tk
    except Exception as e:  # noqa: BLE001 - no Triton is a failed row, not the end
        def missing(*args, error=f"{type(e).__name__}: {e}"):
            raise RuntimeError(f"the Triton kernels did not import: {error}")

        out["triton"] = (missing, missing, lambda op: contextlib.nullcontext())
        return out
    out["triton"] = (
        lambda x, fmt, o: tk.quantize_fp8_rows_triton(x, fmt, out=o),
        lambda p, dim, fmt, y: tk.dequantize_fp8_rows_triton(p, dim, fmt, y.dtype, out=y),
        lambda op: contextlib.nullcontext())
    return out


def _poisoned(shape, dtype, device, pattern: int) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.numel():
        t.view(torch.uint8).fill_(pattern)
    return t


def check_cases(timed) -> List[tuple]:
    """(rows, dim, dtype, fmt, x, quantize's reference, packed, dequantize's reference) on CPU,
    fresh random values every call: packed has every byte value among its codes."""
    shapes = [(r, d, dt, f) for r, d in CHECK_SHAPES for dt in DTYPES for f in FORMATS]
    shapes += [(r, d, dt, f) for r, d, dt, f, _ in timed]
    cases = []
    for rows, dim, dtype, fmt in shapes:
        x = random_rows(rows, dim, dtype, specials=True)
        want = quantize_rows_ref(x, fmt)
        packed = want.clone()
        packed[:, :dim] = torch.randint(0, 256, (rows, dim), dtype=torch.uint8)
        cases.append((rows, dim, dtype, fmt, x, want, packed,
                      dequantize_rows_ref(packed, dim, fmt, dtype)))
    return cases


def check(op: str, fns, context, cases, device: str) -> str:
    """"exact" when the provider's `op` equals the reference on every case, poisoned outputs
    included, else "FAILED: <case>: <what differed>"."""
    quantize, dequantize, _ = fns
    with context(op):
        for rows, dim, dtype, fmt, x, want_packed, packed, want_values in cases:
            name = f"{rows}x{dim} {DTYPE_NAMES[dtype]} {fmt}"
            expected = want_packed if op == "quantize" else want_values
            source = (x if op == "quantize" else packed).to(device)
            for pattern in (0x5A, 0xA5):
                if op == "quantize":
                    got = _poisoned((rows, dim + 4), torch.uint8, device, pattern)
                    quantize(source, fmt, got)
                else:
                    got = _poisoned((rows, dim), dtype, device, pattern)
                    dequantize(source, dim, fmt, got)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()  # a kernel's error belongs to this provider
                problem = _differs(op, got, expected)
                if problem:
                    return f"FAILED: {op} {name}, output poisoned 0x{pattern:X}: {problem}"
    return "exact"


def _round_trip_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x[:4096].double().cpu(), y[:4096].double().cpu()
    return float(10 * torch.log10(x.pow(2).sum() / (y - x).pow(2).sum()))


def _plain_check(quantize: Callable, dequantize: Callable, x: torch.Tensor) -> str:
    """The plain codec (e4m3) decodes what it encoded within e4m3's precision (3 mantissa bits,
    about 31 dB on these rows)."""
    db = _round_trip_db(x, dequantize(*quantize(x)).float())
    return f"close: round trip {db:.1f} dB" if db > 28.0 else \
        f"FAILED: round trip {db:.1f} dB, want > 28 (e4m3)"


def _group(op: str, rows: int, dim: int, dtype, fmt: str) -> str:
    return f"{FAMILIES[op]} {rows}x{dim} {DTYPE_NAMES[dtype]} {fmt}"


def _sets(rows, dim, dtype, fmt, device, count):
    """Timing inputs: per set x, its packed rows (warp_per_row's bytes are the reference's),
    an output for each op, and the plain codec's (codes, scale) of x."""
    from recxla.ops.gpu_variants import use_variant

    out = []
    for _ in range(count):
        x = random_rows(rows, dim, dtype).to(device)
        packed = torch.empty(rows, dim + 4, dtype=torch.uint8, device=device)
        with use_variant(FAMILIES["quantize"], "warp_per_row"):
            torch.ops.recxla.quantize_fp8_rows_out(x, fmt, packed)
        out.append({"x": x, "packed": packed, "q_out": torch.empty_like(packed),
                    "dq_out": torch.empty_like(x), "plain": plain_quantize(x)})
    return out


def run(device: str, dry_run: bool) -> dict:
    began = time.monotonic()
    timing = {"iters": 2, "warmup": 1} if dry_run else {"iters": 40, "warmup": 3}
    guard = Guard(device)
    providers = _providers(device)
    timed = DRY_TIMED if dry_run else TIMED
    rows: List[dict] = []

    # Checks first, once per provider and op, on fresh inputs; the reference runs once per case.
    cases = check_cases(timed)
    checks: Dict[Tuple[str, str], str] = {}
    for name, fns in providers.items():
        # Triton compiles a kernel per shape and dtype: it is checked on the timed shapes only
        # (tests/test_fp8_rows_triton.py covers the rest).
        mine = cases if name.startswith("cuda:") else cases[-len(timed):]
        for op in FAMILIES:
            result, error = guard(f"{name} {op}", lambda fns=fns, op=op, mine=mine: check(
                op, fns, fns[2], mine, device))
            checks[(name, op)] = error or result

    compiled = {}
    for rows_n, dim, dtype, fmt, what in timed:
        xbytes = rows_n * dim * torch.empty(0, dtype=dtype).element_size()
        nbytes = xbytes + rows_n * (dim + 4)
        count = 2 if dry_run else rotation_count(2 * nbytes, limit=64)
        made, error = guard("inputs", lambda: _sets(rows_n, dim, dtype, fmt, device, count))
        if error:
            for op in FAMILIES:
                rows.append(failed_row(_group(op, rows_n, dim, dtype, fmt), "inputs", error))
            continue
        sets = made
        copied, error = guard(DEVICE_COPY, lambda: time_calls(
            *copy_fn(nbytes // 2, device, sets=count), timing["warmup"], timing["iters"], device))
        copy_us = None if error else copied["median_us"]
        extra = {"shape": [rows_n, dim], "dtype": DTYPE_NAMES[dtype], "fmt": fmt, "what": what}
        for op in FAMILIES:
            group = _group(op, rows_n, dim, dtype, fmt)
            rows.append(failed_row(group, DEVICE_COPY, error) if error else
                        row(group, DEVICE_COPY, copied, nbytes, copy_us, check="baseline", **extra))
            for name, fns in providers.items():
                rows.append(_time(guard, op, group, name, fns, sets, fmt, dim, nbytes, copy_us,
                                  checks[(name, op)], timing, extra))
            for label, fn in _baselines(op, compiled, group, dtype, dry_run, began):
                rows.append(_time_baseline(guard, group, label, fn, op, sets, nbytes, copy_us,
                                           timing, extra))
        del sets, made
    if device.startswith("cuda") and not guard.poisoned:
        torch.cuda.empty_cache()
    return {"rows": rows,
            "choices": _choices(rows, timed, device, dry_run, began, timing["iters"])}


def _time(guard, op, group, name, fns, sets, fmt, dim, nbytes, copy_us, check_text, timing,
          extra) -> dict:
    """A recxla provider's row: timed if its check passed, else failed."""
    if check_text.startswith("FAILED"):
        return failed_row(group, name, check_text)
    quantize, dequantize, context = fns
    if op == "quantize":
        args = [(s["x"], s["q_out"]) for s in sets]
        fn = lambda x, o: quantize(x, fmt, o)  # noqa: E731
    else:
        args = [(s["packed"], s["dq_out"]) for s in sets]
        fn = lambda p, y: dequantize(p, dim, fmt, y)  # noqa: E731

    def timed():
        with context(op):
            return time_calls(fn, args, timing["warmup"], timing["iters"], guard.device)

    result, error = guard(f"{name} {op}", timed)
    if error:
        return failed_row(group, name, error)
    return row(group, name, result, nbytes, copy_us, check=check_text, **extra)


def _baselines(op, compiled, group, dtype, dry_run, began):
    """[(provider, function of one input set)]: plain PyTorch, and its torch.compile (GPU only,
    float32 only, while the budget lasts: a new shape may recompile, which takes seconds)."""
    plain = plain_quantize if op == "quantize" else plain_dequantize
    out = [(PLAIN, plain)]
    if dry_run or dtype != torch.float32:
        return out
    left = BUDGET_S - (time.monotonic() - began)
    if left < COMPILE_NEEDS_S:
        print(f"fp8_rows: {COMPILED} not run on {group}: {left:.0f} s of the module's "
              f"{BUDGET_S:.0f} s were left")
        return out
    if op not in compiled:
        compiled[op] = torch.compile(plain)
    return out + [(COMPILED, compiled[op])]


def _time_baseline(guard, group, label, fn, op, sets, nbytes, copy_us, timing, extra) -> dict:
    if op == "quantize":
        args = [(s["x"],) for s in sets]
        first = lambda: _plain_check(fn, plain_dequantize, sets[0]["x"])  # noqa: E731
    else:
        args = [s["plain"] for s in sets]
        first = lambda: _plain_check(plain_quantize, fn, sets[0]["x"])  # noqa: E731
    check_text, error = guard(label, first)  # also compiles, outside the timed calls
    if error or check_text.startswith("FAILED"):
        return failed_row(group, label, error or check_text)
    result, error = guard(label, lambda: time_calls(fn, args, timing["warmup"], timing["iters"],
                                                    guard.device))
    if error:
        return failed_row(group, label, error)
    return row(group, label, result, nbytes, copy_us, check=check_text, baseline_fmt="e4m3",
               **extra)


def _choices(rows, timed, device, dry_run, began, iters) -> list:
    """Per family, the variant with the least geometric mean over the timed shapes of its
    median over the best variant's median there (it must have passed and been timed on each);
    the fallback stays unless the fastest beats it by NOISE."""
    from recxla.ops.gpu_variants import variants

    choices = []
    for op, family in FAMILIES.items():
        names = variants(family)
        groups = [_group(op, r, d, dt, f) for r, d, dt, f, _ in timed]
        median = {(r["provider"], r["group"]): r["median_us"] for r in rows
                  if r["group"] in groups and r["median_us"] is not None
                  and not r["check"].startswith("FAILED")}
        timed_all = [v for v in names if all((f"cuda:{v}", g) in median for g in groups)]
        if not timed_all:
            why = "no variant passed its check and was timed on every shape: kept the fallback"
            choices.append(choice(family, names[0], why, device, dry_run, began))
            continue
        best = {g: min(median[(f"cuda:{v}", g)] for v in timed_all) for g in groups}
        score = {v: math.exp(sum(math.log(median[(f"cuda:{v}", g)] / best[g]) for g in groups)
                             / len(groups)) for v in timed_all}
        winner = min(score, key=score.get)
        fallback = names[0]
        kept = (winner != fallback and fallback in score
                and score[fallback] < NOISE * score[winner])
        if kept:
            winner = fallback
        copies = {g: median.get((DEVICE_COPY, g)) for g in groups}

        def figures(v):
            return ", ".join(
                f"{median[(f'cuda:{v}', g)]:.1f} us" +
                (f" ({copies[g] / median[(f'cuda:{v}', g)]:.2f}x copy)" if copies[g] else "")
                for g in groups)

        shapes = "; ".join(g.split(" ", 1)[1] for g in groups)
        others = "; ".join(f"{v} {score[v]:.2f}x" for v in timed_all if v != winner)
        why = (f"{winner} took {figures(winner)} on {shapes} (median of {iters} "
               f"calls); geometric mean of time over the best variant's: {winner} "
               f"{score[winner]:.2f}x, {others or 'no other variant'}")
        if kept:
            why += f" (kept: the fastest was within {100 * (NOISE - 1):.0f}% of it)"
        choices.append(choice(family, winner, why, device, dry_run, began))
    return choices
