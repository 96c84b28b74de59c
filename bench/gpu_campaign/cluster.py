"""Campaign stage: key-centric sample clustering (family "cluster") at batch 8192.

What it times, per M = 2, 4, 8 (groups "cluster criteo batch 8192, M=<m>", 16 batches of the
Criteo-like profile of bench/bench_clustering.py, ~700,000 ids over 26 features, rotated):
`recxla.cluster_samples` with each GPU variant ("cuda:passes", "cuda:fused", RECXLA_BACKEND=cuda)
and with the Triton backend ("triton", which runs "passes"); the C++ CPU kernel on one thread
(the figure to beat: 3.8 ms at M = 4, bench/results/clustering.md), timed with the host clock;
and the plain-PyTorch reference on the GPU. Before any timing every provider is checked against
the CPU kernel's permutation (`torch.ops.recxla.cluster_permutation` on the same batch on CPU:
the contract is bit for bit on every backend) on fresh random batches: Criteo batches at each
M, int32 ids and lengths, key bytes of 0 and of several sizes, 9 / 33 / 150 micro-batches (the
fused gains' three paths), small odd batches, and on the GPU a count table sized by a read-back
(M = 500) and a move block whose scratch lies in global memory (40,000 samples). A provider
that fails is recorded "FAILED: ..." and neither timed nor chosen; a CUDA error (a poisoned
context) stops every later CUDA call and the rows say so. The winner: the variant with the
least summed median over the three M.

Where "passes" spent its 6.37 / 5.78 / 5.59 ms (H100, M = 2 / 4 / 8, measured before this
module existed) - counted on CPU tensors through the same Python path (`census`; the counts do
not depend on M for this batch, whose 4 move rounds all move groups):
- 233 torch ops dispatched from Python, ~400 kernels on a GPU (estimated per op: CUB sorts ~6
  each, unique ~10, the CUDA gains op 79: three launches per feature in a loop over 26);
- 64 device-to-host syncs inside it, 66 with cluster_samples' two length checks: 20 `.tolist()`,
  9 `int()`/`bool()`, 20 from `torch.bincount` (it reads min and max back on CUDA), 6 host
  copies of bag offsets in `cluster_bag_signatures`, 6 host lists copied up, nonzero, unique;
- loops: 26 features (gains), 6 ranked features (signatures), 4 rounds (each: bincount, 3 host
  lists, a Python loop over the movers, a host list copied back).
At ~8-10 us of host time per dispatched op (Python, dispatcher, allocator, launch) the ops cost
~2.0-2.3 ms; each sync drains the queue and idles the GPU while the host turns around, ~30 us:
~2.0 ms; the gains op's 79 launches ~0.3 ms; Python loops and lists ~0.4 ms: ~5-6 ms, which is
what was measured. The GPU's own work (a few us per kernel) hides behind the host.

Predictions for "fused" (recxla::cluster_permutation_fused, csrc/cuda/cluster_fused.cu), written
before any GPU run (H100, sm_90; not measurements):
- One sync (the lengths' check: a per-feature pass and a 1 KB read-back, ~25 us), then ~44
  device operations queued without waiting: a copy up, 2 fills (~22 MB: the pair tables are
  sized for all ~533k values of the 6 largest features, ~8 us), ~15 one-launch steps, CUB's
  merge sort of 8192 24-byte records (~9 launches: 512-record tiles, 4 merge passes), 2 scans
  (2 each), a radix sort by bin (1-3), 4 rounds x 3 launches (gains, moves, update).
- Host: ~3 us per launch, ~5 us more per CUB call, a pinned staging buffer and the Python of
  cluster_samples (~40 us): ~200 us; device: ~3-5 us per step, the largest being the scoring
  pass (700k ids, ~6 us), the pair insert (lanes of 32 per bag, ~5 us) and the move block
  (362 groups: a 512-entry bitonic sort and the sequential walk, ~10 us a round).
- So ~0.2-0.3 ms per cluster_samples call at M = 2, 4 and 8 alike (>= 15x "passes", >= 12x the
  CPU kernel on one thread); the target, <= 0.5 ms, is predicted met. A figure above ~0.4 ms
  would point at host overhead (the CUB calls' set-up, the allocator), not at the kernels.
- "triton" runs "passes" with Triton key passes: ~5-7 ms, like "cuda:passes".
"""

import contextlib
import time
from typing import Callable, Dict, List

import torch

from bench.common import one_thread
from bench.gpu_campaign.timing import (
    Guard, choice, failed_row, least_summed_median, medians_by_group, row, time_calls,
)
from bench.gpu_campaign.timing import backend as backend_env

FAMILY = "cluster"
BATCH = 8192
MICRO_BATCHES = (2, 4, 8)
GROUP = "cluster criteo batch {batch}, M={m}"
BUDGET_S = 40.0  # the kernels stage gives a module 50 s
REFERENCE_NEEDS_S = 8.0  # the slow reference is timed last, only while this much is left
CPU_KERNEL = "C++ CPU kernel, 1 thread"
REFERENCE = "torch reference"


def criteo_batch(seed: int, batch: int):
    """The sparse features of one batch of the default profile (CPU)."""
    from recxla.data import SyntheticRankingDataset, criteo_kaggle_profile

    dataset = SyntheticRankingDataset(criteo_kaggle_profile(), batch_size=batch, seed=seed)
    return dataset.batch(0).sparse


def _kjt(values: torch.Tensor, lengths: torch.Tensor, batch: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = [f"f{i}" for i in range(lengths.numel() // batch)]
    return KeyedJaggedTensor(keys, values, lengths=lengths, stride=batch)


def check_cases(device: str, dry_run: bool) -> List[tuple]:
    """(name, kjt, M, key_bytes) on CPU, fresh random every call."""
    seed = int(torch.randint(1, 2**30, ()))
    batch, odd = (96, 96) if dry_run else (BATCH, 600)
    cases = []
    full = criteo_batch(seed, batch)
    for m in MICRO_BATCHES:
        cases.append((f"criteo B={batch}", full, m, None))
    as32 = _kjt(full.values().int(), full.lengths().int(), batch)
    cases.append((f"criteo B={batch}, int32 ids and lengths", as32, 4, None))
    small = criteo_batch(seed + 1, odd)
    key_bytes = (torch.randint(0, 4, (26,)).double() * 68).tolist()  # some features cost nothing
    cases.append((f"criteo B={odd}, key bytes 0-204", small, 3, key_bytes))
    for m in ((9, 33) if dry_run else (9, 33, 150)):
        cases.append((f"criteo B={odd}, many micro-batches", small, m, None))
    for batch_, features, m in ((1, 3, 1), (37, 0, 5), (45, 1, 7), (40, 8, 40), (64, 5, 3)):
        lengths = torch.randint(0, 5, (features * batch_,))
        values = torch.randint(-12, 12, (int(lengths.sum()),))
        cases.append((f"random B={batch_} F={features}", _kjt(values, lengths, batch_), m, None))
    if device.startswith("cuda"):
        lengths = torch.randint(250, 350, (1000,))  # U / 2 * M * 4 bytes > 256 MiB: exact count
        users = torch.randint(0, 100, (1000,)).repeat_interleave(lengths)
        values = users * 20 + torch.randint(0, 20, (int(lengths.sum()),))
        cases.append(("M=500, count table sized by a read-back", _kjt(values, lengths, 1000),
                      500, None))
        lengths = torch.randint(1, 4, (2 * 40000,))  # 2**16 move slots: global scratch
        values = torch.randint(0, 5000, (int(lengths.sum()),))
        cases.append(("B=40000, move scratch in global memory", _kjt(values, lengths, 40000),
                      4, None))
    return cases


@contextlib.contextmanager
def _variant(backend: str, variant: str):
    from recxla.ops import gpu_variants

    with backend_env(backend), gpu_variants.use_variant(FAMILY, variant):
        yield


def _weights(kjt, key_bytes) -> torch.Tensor:
    from recxla.ops.cluster_checks import key_bytes_tensor

    return key_bytes_tensor(kjt, key_bytes, "campaign")


def providers(device: str) -> Dict[str, tuple]:
    """name -> (fn(kjt, m, key_bytes) -> permutation, context factory, timing device). On CPU
    (the dry run) each GPU variant runs its own code on CPU tensors: "fused" the op's host run,
    "passes" the Python path with the CPU key passes, "triton" with interpreted Triton ones."""
    import recxla
    from recxla.ops import cluster
    from recxla.reference.cluster import cluster_samples_ref

    def api(kjt, m, key_bytes):
        return recxla.cluster_samples(kjt, m, key_bytes)[0]

    def reference(kjt, m, key_bytes):
        return cluster_samples_ref(kjt, m, key_bytes)[0]

    out = {}
    if device.startswith("cuda"):
        from recxla.ops import gpu_variants

        for variant in gpu_variants.variants(FAMILY):
            out[f"cuda:{variant}"] = (api, lambda v=variant: _variant("cuda", v), device)
        out["triton"] = (api, lambda: _variant("triton", "passes"), device)
    else:
        from recxla.triton_kernels import interpreted

        def fused(kjt, m, key_bytes):
            return torch.ops.recxla.cluster_permutation_fused(
                kjt.values(), kjt.lengths(), kjt.stride(), m, _weights(kjt, key_bytes).tolist())

        def with_passes(passes):
            def fn(kjt, m, key_bytes):
                return cluster.cluster_permutation_with_passes(
                    kjt.values(), kjt.lengths(), kjt.stride(), m, _weights(kjt, key_bytes), passes)
            return fn

        cpu_passes = cluster.KeyPasses(torch.ops.recxla.cluster_feature_gains,
                                          torch.ops.recxla.cluster_bag_signatures)
        triton = interpreted("cluster")
        out["cuda:passes"] = (with_passes(cpu_passes), contextlib.nullcontext, "cpu")
        out["cuda:fused"] = (fused, contextlib.nullcontext, "cpu")
        out["triton"] = (with_passes(cluster.KeyPasses(triton.feature_gains,
                                                          triton.bag_signatures)),
                         contextlib.nullcontext, "cpu")
    out[CPU_KERNEL] = (api, one_thread, "cpu")
    out[REFERENCE] = (reference, contextlib.nullcontext, device)
    return out


def check(fn: Callable, cases, device: str, quick: bool) -> str:
    """"exact" when fn's permutation equals the CPU kernel's on every case (quick: the first
    and the odd ones only, for the interpreted Triton path), else "FAILED: <case>: ..."."""
    for index, (name, kjt, m, key_bytes) in enumerate(cases):
        if quick and 0 < index < 4:
            continue
        want = torch.ops.recxla.cluster_permutation(
            kjt.values(), kjt.lengths(), kjt.stride(), m, _weights(kjt, key_bytes).tolist())
        got = fn(kjt.to(torch.device(device)), m, key_bytes).cpu()
        if got.dtype != torch.int64 or got.shape != want.shape:
            return (f"FAILED: {name} M={m}: got {got.dtype} {tuple(got.shape)}, "
                    f"want int64 {tuple(want.shape)}")
        diff = torch.nonzero(got != want)
        if diff.numel():
            k = int(diff[0])
            return (f"FAILED: {name} M={m}: permutation[{k}] = {int(got[k])}, want "
                    f"{int(want[k])} ({diff.numel()} of {want.numel()} differ)")
    return "exact"


def census(kjt, m: int) -> dict:
    """What "passes" asks of a GPU, counted on CPU tensors through its Python path: torch ops
    dispatched, kernels they would launch on CUDA (estimates per op), device-to-host syncs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from recxla.ops import cluster

    kernels_of = {"sort": 6, "cumsum": 2, "_unique2": 10, "nonzero": 3, "bincount": 4,
                  "repeat_interleave": 3, "cluster_feature_gains": 3 * len(kjt.keys()) + 1}
    syncs_of = {"_local_scalar_dense": 1, "nonzero": 1, "_unique2": 1, "bincount": 2,
                "cluster_bag_signatures": 1, "lift_fresh": 1}
    counts = {"ops": 0, "kernels": 0, "syncs": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            counts["syncs"] += syncs_of.get(name, 0)
            if not func.is_view and name not in ("lift_fresh", "alias", "detach"):
                counts["ops"] += 1
                counts["kernels"] += kernels_of.get(name, 1)
            return func(*args, **(kwargs or {}))

    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu")}

    def counted(name):
        def call(self, *a, **k):
            counts["syncs"] += 1
            return saved[name](self, *a, **k)
        return call

    passes = cluster.KeyPasses(torch.ops.recxla.cluster_feature_gains,
                                  torch.ops.recxla.cluster_bag_signatures)
    weights = _weights(kjt, None)
    try:
        for name in saved:
            setattr(torch.Tensor, name, counted(name))
        with Count():
            cluster.cluster_permutation_with_passes(
                kjt.values(), kjt.lengths(), kjt.stride(), m, weights, passes)
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
    return counts


def run(device: str, dry_run: bool) -> dict:
    from recxla.ops import gpu_variants

    began = time.monotonic()
    on_gpu = device.startswith("cuda")
    batch = 96 if dry_run else BATCH
    timing = {"warmup": 1, "iters": 2} if dry_run else {"warmup": 3, "iters": 30}
    slow = {"warmup": 0, "iters": 1} if dry_run else {"warmup": 1, "iters": 8}
    guard = Guard(device)
    table = providers(device)
    rows: List[dict] = []

    cases = check_cases(device, dry_run)
    checks = {}
    for name, (fn, context, where) in table.items():
        def checked(fn=fn, context=context, where=where, name=name):
            with context():
                return check(fn, cases, where, quick=dry_run and name == "triton")

        result, error = guard(name, checked, on_cuda=where.startswith("cuda"))
        checks[name] = error or result

    sets = [criteo_batch(1000 + k, batch) for k in range(2 if dry_run else 16)]
    moved, copy_error = guard("the batches' copy to the device",
                              lambda: [k.to(torch.device(device)) for k in sets], on_cuda=on_gpu)
    on_device = {"cpu": sets, device: moved or []}
    for m in MICRO_BATCHES:
        group = GROUP.format(batch=batch, m=m)
        for name, (fn, context, where) in table.items():
            if checks[name].startswith("FAILED"):
                rows.append(failed_row(group, name, checks[name]))
                continue
            left = BUDGET_S - (time.monotonic() - began)
            if name == REFERENCE and not dry_run and left < REFERENCE_NEEDS_S:
                rows.append(failed_row(group, name, f"not run: {BUDGET_S - left:.0f} s of the "
                                                    f"module's {BUDGET_S:.0f} s were used"))
                continue
            args = [(k, m, None) for k in on_device[where]]
            if not args:
                rows.append(failed_row(group, name, copy_error or "no input sets"))
                continue
            interpreted = dry_run and name == "triton"
            plan = slow if name == REFERENCE or interpreted else timing

            def timed(fn=fn, context=context, where=where, args=args, plan=plan):
                with context():
                    return time_calls(fn, args, plan["warmup"], plan["iters"], where)

            result, error = guard(name, timed, on_cuda=where.startswith("cuda"))
            if error:
                rows.append(failed_row(group, name, error))
                continue
            extra = {"m": m, "batch": batch, "timed_on": where}
            if name == "cuda:passes":
                extra["census"] = census(sets[0], m)
            rows.append(row(group, name, result, check=checks[name], **extra))
    if on_gpu and not guard.poisoned:
        torch.cuda.empty_cache()
    return {"rows": rows, "choices": _choices(rows, gpu_variants.variants(FAMILY), device,
                                              dry_run, began)}


def _choices(rows: List[dict], variants: List[str], device: str, dry_run: bool, began: float):
    """The variant with the least summed median over the M groups (timed and passed in each)."""
    groups = sorted({r["group"] for r in rows}, key=lambda g: int(g.rsplit("=", 1)[1]))
    winner = least_summed_median(rows, variants, groups)
    if winner is None:
        return []

    def figures(provider):
        got = medians_by_group(rows, provider)
        return " / ".join(f"{got[g]:.0f}" if g in got else "n/a" for g in groups) + " us"

    ms = " / ".join(g.rsplit("=", 1)[1] for g in groups)
    others = "; ".join(f"{v} {figures('cuda:' + v)}" for v in variants if v != winner)
    best = min(medians_by_group(rows, f"cuda:{winner}").values())
    why = (f"{winner} took {figures('cuda:' + winner)} per call (M = {ms}) "
           f"against {others or 'no other variant'}; the C++ CPU kernel on one thread "
           f"{figures(CPU_KERNEL)}; target <= 500 us {'met' if best <= 500 else 'missed'} at "
           f"best ({best:.0f} us)")
    return [choice(FAMILY, winner, why, device, dry_run, began)]
