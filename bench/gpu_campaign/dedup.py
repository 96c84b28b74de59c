"""Campaign stage: segmented key dedup (family "dedup") on one Criteo-profile batch.

Every variant of the family (`recxla.ops.gpu_variants.variants("dedup")`), the Triton path
(RECXLA_BACKEND=triton), one torch.unique over (table, key) as bench/bench_dedup.py builds it,
the same function under torch.compile (last, and only if the module has time left: its compile
may take tens of seconds), and a device copy of the bytes the op must move at least: keys in,
unique keys and the int64 inverse out. The batch (8192 samples, 26 Criteo tables, ~262k keys:
Zipf ~67.5k unique, uniform ~142.7k unique) and the torch.unique baseline are imported from
bench/bench_dedup.py. Groups: Zipf int64, uniform int64 (the winner is the variant with the
least sum of the two medians) and Zipf int32. Calls rotate over 16 batches (seeds 1000-1015,
timing.py); 60 timed calls after 5 warm-up calls.

Check (before any timing): each provider against recxla.reference.dedup on fresh random inputs
(a new seed each run): Criteo batches (Zipf and uniform int64, Zipf int32) and odd shapes (no
segment, empty segments, negative keys, int32 keys over their whole range, a single key, one
distinct key (a 0-bit sort), 2^27-wide keys in 32 segments that fill a 32-bit word, keys over
all of int64 in one segment (a 64-bit key field) and in four (the packed variant's fallback to
the segmented sort), 3000 tiny segments, one segment of 2^20 keys). Outputs are compared bit
for bit: values, offsets, inverse. Unwritten output elements are caught: recxla's paths are
checked with torch's deterministic fill of uninitialized memory (every torch.empty, C++
at::empty included, starts at the dtype's largest value). The packed variant's row lists which
path each case took ("plans"). A provider that fails is recorded "FAILED: ..." and neither timed
nor chosen; a CUDA error (a poisoned context) stops every later CUDA call, and the rows say so.

Predictions, written before any GPU run (H100 SXM, sm_90; not measurements):
- Where "segmented_sort" spends its ~355 us: CUB's segmented radix sort gives each of the 26
  segments one thread block (26 of 132 SMs busy), which runs all 64 key bits in 6-bit digits
  (11 passes, each an upsweep and a downsweep over its segment) alone; the largest segments
  hold ~16.5k keys, so the sort is a chain of ~22 sweeps of 16k keys by one SM: ~280-300 us.
  The rest: 2 host syncs (~10-15 us each: the GPU idles while the host turns around) and the
  int64 head flags, scan and scatter (~15 us).
- "packed_radix_sort", bytes per call (Zipf int64, n = 262k): probe reads 2.1 MB, then one
  sync; pack reads 2.1 MB and writes 2.1 MB of 32-bit words and int32 positions; CUB's
  onesweep sort over 29 bits (24 key + 5 segment) = a histogram pass (1 MB) and 4 passes of
  8 bits, each reading and writing 8 bytes a key (4.2 MB a pass), 30 tiles of 8832 keys a
  pass; int32 heads and their scan (4.2 MB); sync; scatter (5.8 MB). About 34 MB in all, most
  of it from the 50 MB L2, so passes, launches and syncs set the time, not bytes. Predicted:
  probe + sync ~15 us, pack ~3, sort ~30-45, heads + scan + offsets ~8, sync ~10, scatter ~4:
  70-120 us per call, Zipf and uniform alike (uniform writes 2x the unique keys), i.e. 4-6x
  torch.unique over (table, key), which took 486/468 us (Zipf/uniform) on an H100 earlier.
- int32 keys: the same 4 passes over 32-bit words; a few us less (probe and pack read half).
- The device copy of ~4.7 MB (Zipf int64; half read, half written): ~3-5 us with its launch.
  Every provider stays far from it: this op is bound by latency, not bandwidth.
- The module on the GPU: ~10 s of imports, batches and checks (Triton compiles its 2 kernels),
  ~2 s of timing, and torch.compile's compile (~10-20 s): 25-35 s in all.
"""

import contextlib
import importlib
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch

from bench.bench_dedup import criteo_batch, torch_unique_combined
from bench.gpu_campaign.timing import (
    DEVICE_COPY, Guard, backend, choice, copy_fn, failed_row, least_summed_median,
    medians_by_group, rotation_count, row, time_calls,
)
from recxla.reference.dedup import segmented_unique_ref

FAMILY = "dedup"
GROUP = "dedup criteo batch 8192 x 26 tables"
# The module's whole GPU run stays within ~40 s (the kernels stage gives it 50); torch.compile,
# which alone may take tens of seconds, runs last and only while this much time is left.
BUDGET_S = 40.0
COMPILE_NEEDS_S = 20.0
# Provider names follow report.py: recxla's variants "cuda:<variant>" (in the dry run the C++
# CPU op stands in for each), "triton", and the baselines by what they are.
BASELINE = "torch.unique"
COMPILED = "torch.compile(torch.unique)"


def _shrink(values: torch.Tensor, offsets: torch.Tensor, keep: int):
    """The first `keep` keys of every segment (the dry run's small batch)."""
    bounds = offsets.tolist()
    parts = [values[a:min(b, a + keep)] for a, b in zip(bounds[:-1], bounds[1:])]
    lengths = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    new_offsets = torch.zeros(len(parts) + 1, dtype=torch.int64)
    new_offsets[1:] = lengths.cumsum(0)
    return torch.cat(parts), new_offsets


def _batch(distribution: str, dtype, seed: int, dry_run: bool):
    values, offsets = criteo_batch(distribution, dtype, seed=seed)
    return _shrink(values, offsets, 64) if dry_run else (values, offsets)


def _offsets(lengths) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if len(lengths):
        out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out


def check_cases(dry_run: bool) -> List[Tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, values, offsets) on CPU, fresh random keys every call (the timed batches use
    fixed seeds; these never repeat)."""
    seed = int(torch.randint(1, 2**30, ()))
    i64, i32 = torch.iinfo(torch.int64), torch.iinfo(torch.int32)
    tiny = 500 if dry_run else 3000
    cases = [
        ("criteo zipf int64", *_batch("zipf", torch.int64, seed, dry_run)),
        ("criteo uniform int64", *_batch("uniform", torch.int64, seed + 1, dry_run)),
        ("criteo zipf int32", *_batch("zipf", torch.int32, seed + 2, dry_run)),
        ("no segment", torch.zeros(0, dtype=torch.int64), _offsets([])),
        ("empty segments only", torch.zeros(0, dtype=torch.int32), _offsets([0, 0, 0])),
        ("a single key", torch.randint(-99, 99, (1,)), _offsets([0, 1, 0])),
    ]
    lengths = [0, 700, 0, 0, 1300, 1, 0, 2000]
    cases.append(("empty segments, negative keys", torch.randint(-(2**40), 2**40, (sum(lengths),)),
                  _offsets(lengths)))
    cases.append(("int32 keys over the whole range",
                  torch.randint(i32.min, i32.max, (5000,), dtype=torch.int32),
                  _offsets([1000, 0, 2500, 1500])))
    cases.append(("one distinct key, one segment", torch.full((4000,), -7, dtype=torch.int64),
                  _offsets([4000])))
    # 27 key bits + 5 segment bits: a 32-bit word with its top bit in use.
    low = int(torch.randint(-(2**40), 2**40, ()))
    fill = torch.randint(low, low + 2**27, (32 * 150,))
    fill[0], fill[1] = low, low + 2**27 - 1
    cases.append(("32-bit words, every bit used", fill, _offsets([150] * 32)))
    full = torch.randint(i64.min, i64.max, (6000,))
    full[0], full[1] = i64.min, i64.max
    cases.append(("int64 keys over the whole range, one segment", full, _offsets([6000])))
    cases.append(("int64 keys over the whole range, 4 segments (fallback)", full.flip(0),
                  _offsets([2000, 0, 1000, 3000])))
    small = torch.randint(0, 4, (tiny,)).tolist()
    cases.append((f"{tiny} tiny segments", torch.randint(-5, 5, (sum(small),)), _offsets(small)))
    big = 5000 if dry_run else 1 << 20
    cases.append((f"one segment of {big} keys", torch.randint(0, 10_000_000, (big,)),
                  _offsets([big])))
    return cases


def _plan_note(values: torch.Tensor, offsets: torch.Tensor) -> str:
    """Which path the packed variant takes on a case (its plan hook exists in CUDA builds)."""
    if values.numel() == 0:
        return "no keys"
    try:
        plan = torch.ops.recxla._dedup_packed_plan(offsets.numel() - 1, int(values.min()),
                                                   int(values.max()), values.dtype)
    except (AttributeError, RuntimeError):
        return "plan unknown (this build has no CUDA kernels)"
    key_bits, segment_bits, end_bit, word = plan
    path = f"{8 * word}-bit words" if word else "the segmented sort"
    return f"{key_bits}+{segment_bits}={end_bit} bits: {path}"


@contextlib.contextmanager
def _variant(name: str):
    from recxla.ops import gpu_variants

    with backend("cuda"), gpu_variants.use_variant(FAMILY, name):
        yield


@contextlib.contextmanager
def _fill_uninitialized():
    """torch's deterministic mode fills every new tensor (torch.empty and C++ at::empty alike)
    with the dtype's largest value, so an output element a kernel leaves unwritten differs from
    the reference."""
    before = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(before)
            torch.utils.deterministic.fill_uninitialized_memory = fill


def _compare(name: str, got, want) -> Optional[str]:
    labels = ("unique_values", "unique_offsets", "inverse")
    for label, g, w in zip(labels, got, want):
        g = g.detach().cpu()
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"{name}: {label} is {g.dtype} {tuple(g.shape)}, want {w.dtype} {tuple(w.shape)}"
        diff = torch.nonzero(g != w)
        if diff.numel():
            k = int(diff[0])
            return f"{name}: {label}[{k}] = {int(g[k])}, want {int(w[k])}"
    return None


def check(fn: Callable, cases, device: str, poison: bool = True) -> str:
    """"exact" when fn(values, offsets) equals the reference bit for bit on every case of
    (name, values, offsets, reference result), else "FAILED: <case>: <what differed>".
    poison: run with uninitialized memory filled (recxla's paths; the baselines run as timed,
    since torch.compile would recompile for deterministic mode)."""
    with _fill_uninitialized() if poison else contextlib.nullcontext():
        for name, values, offsets, want in cases:
            problem = _compare(name, fn(values.to(device), offsets.to(device)), want)
            if problem:
                return f"FAILED: {problem}"
    return "exact"


def cases_for(provider: str, cases):
    """The check cases of a provider: recxla's paths take them all; the baselines only the
    Criteo batches they are timed on (bench_dedup's packing assumes keys below 2^40), and the
    compiled one only int64, so that it compiles once."""
    if provider == BASELINE:
        return [c for c in cases if c[0].startswith("criteo")]
    if provider == COMPILED:
        return [c for c in cases if c[0].startswith("criteo") and c[0].endswith("int64")]
    return cases


def _providers(device: str) -> Dict[str, Tuple[Callable, Callable]]:
    """name -> (function of (values, offsets), factory of the context to run it in); the
    compiled baseline is made apart, last (`run`)."""
    from recxla.ops import gpu_variants
    from recxla.ops.dedup import segmented_unique

    out = {}
    for variant in gpu_variants.variants(FAMILY):
        out[f"cuda:{variant}"] = (segmented_unique, lambda v=variant: _variant(v))
    if device == "cpu":
        def triton_cpu(values, offsets):  # interpreted: the module as imported now
            module = importlib.import_module("recxla.triton_kernels.dedup")
            return module.segmented_unique_triton(values, offsets)

        out["triton"] = (triton_cpu, contextlib.nullcontext)
    else:
        out["triton"] = (segmented_unique, lambda: backend("triton"))
    out[BASELINE] = (torch_unique_combined, contextlib.nullcontext)
    return out


def _groups(dry_run: bool):
    """[(group name, CPU input sets)]: Zipf and uniform int64, and the Zipf sets as int32."""
    out = []
    for distribution in ("zipf", "uniform"):
        first = _batch(distribution, torch.int64, 1000, dry_run)
        count = 2 if dry_run else rotation_count(first[0].numel() * 8 * 3)
        sets = [first] + [_batch(distribution, torch.int64, 1000 + k, dry_run)
                          for k in range(1, count)]
        out.append((f"{GROUP}, {distribution} int64", sets))
        if distribution == "zipf":
            zipf32 = [(v.to(torch.int32), o) for v, o in sets]
    out.append((f"{GROUP}, zipf int32", zipf32))
    return out


def _time_provider(guard, group, name, fn, context, sets, size, check_text, cases, timing):
    """The provider's row: timed if its check passed, else failed."""
    def timed():
        with context():
            return time_calls(fn, sets, timing["warmup"], timing["iters"], guard.device)

    if check_text.startswith("FAILED"):
        return failed_row(group, name, check_text)
    result, error = guard(name, timed)
    if error:
        return failed_row(group, name, error)
    return row(group, name, result, size["bytes"], size["copy_us"], check=check_text,
               cases=cases, n_keys=size["n_keys"], n_unique=size["n_unique"])


def run(device: str, dry_run: bool) -> dict:
    from recxla.ops import gpu_variants

    began = time.monotonic()
    timing = {"iters": 3, "warmup": 1} if dry_run else {"iters": 60, "warmup": 5}
    guard = Guard(device)
    variants = gpu_variants.variants(FAMILY)
    providers = _providers(device)
    rows: List[dict] = []

    # Checks first, once per provider, on fresh inputs; the reference runs once per case.
    cases = [(name, v, o, segmented_unique_ref(v, o)) for name, v, o in check_cases(dry_run)]
    plans = {name: _plan_note(v, o) for name, v, o, _ in cases}
    checks = {}
    for name, (fn, context) in providers.items():
        def checked(fn=fn, context=context, name=name):
            with context():
                return check(fn, cases_for(name, cases), device, poison=name != BASELINE)

        result, error = guard(name, checked)
        checks[name] = error or result

    sizes = {}
    groups = _groups(dry_run)
    for group, cpu_sets in groups:
        want = segmented_unique_ref(*cpu_sets[0])
        n, unique, key_size = cpu_sets[0][0].numel(), want[0].numel(), want[0].element_size()
        # keys in; unique keys and the int64 inverse out (of the first set)
        size = {"n_keys": n, "n_unique": unique, "copy_us": None,
                "bytes": n * key_size + unique * key_size + n * 8}
        sizes[group] = size
        sets = [(v.to(device), o.to(device)) for v, o in cpu_sets]
        copy, pairs = copy_fn(size["bytes"] // 2, device, sets=len(sets))
        copied, error = guard(DEVICE_COPY, lambda: time_calls(
            copy, pairs, timing["warmup"], timing["iters"], device))
        if error:
            rows.append(failed_row(group, DEVICE_COPY, error))
        else:
            size["copy_us"] = copied["median_us"]
            rows.append(row(group, DEVICE_COPY, copied, size["bytes"], size["copy_us"],
                            check="baseline", n_keys=n, n_unique=unique))
        for name, (fn, context) in providers.items():
            rows.append(_time_provider(guard, group, name, fn, context, sets, size, checks[name],
                                       len(cases_for(name, cases)), timing))
            if name == "cuda:packed_radix_sort":
                rows[-1]["plans"] = plans  # which path each check case took
        del sets, pairs

    if not dry_run:  # torch.compile last: its compile time must not cost the other rows
        _compiled(guard, rows, groups, sizes, cases, timing, began, device)
    if device.startswith("cuda") and not guard.poisoned:
        torch.cuda.empty_cache()
    return {"rows": rows, "choices": _choices(rows, variants, device, dry_run, began)}


def _compiled(guard, rows, groups, sizes, cases, timing, began, device):
    int64_groups = [(g, s) for g, s in groups if g.endswith("int64")]
    used = time.monotonic() - began
    if used > BUDGET_S - COMPILE_NEEDS_S:
        for group, _ in int64_groups:
            rows.append(failed_row(group, COMPILED, f"not run: {used:.0f} s of the module's "
                                   f"{BUDGET_S:.0f} s were used before torch.compile"))
        return
    compiled = torch.compile(torch_unique_combined, dynamic=True)
    checked, error = guard(COMPILED, lambda: check(compiled, cases_for(COMPILED, cases), device,
                                                   poison=False))
    check_text = error or checked
    for group, cpu_sets in int64_groups:
        sets = [(v.to(device), o.to(device)) for v, o in cpu_sets]
        rows.append(_time_provider(guard, group, COMPILED, compiled, contextlib.nullcontext,
                                   sets, sizes[group], check_text,
                                   len(cases_for(COMPILED, cases)), timing))


def _choices(rows, variants, device, dry_run, began) -> list:
    """The winner: the variant with the least summed median over the int64 groups (it must have
    passed and been timed in each)."""
    headline = [r for r in rows if r["group"].endswith("int64")]
    groups = sorted({r["group"] for r in headline})
    winner = least_summed_median(headline, variants, groups)
    if winner is None:
        return []

    def figures(provider):
        got = medians_by_group(headline, provider)
        return " / ".join(f"{got[g]:.1f}" if g in got else "n/a" for g in groups) + " us"

    names = " / ".join(g.split(", ")[-1] for g in groups)
    others = "; ".join(f"{v} {figures('cuda:' + v)}" for v in variants if v != winner)
    why = (f"{winner} took {figures('cuda:' + winner)} ({names}, median of "
           f"{'3' if dry_run else '60'} calls) against {others or 'no other variant'}, and "
           f"torch.unique over (table, key) {figures(BASELINE)}")
    return [choice(FAMILY, winner, why, device, dry_run, began)]
