"""Campaign stage: one training step of the sparse part on a GPU (pooled lookup forward,
backward and the fused row-wise Adagrad update), recxla's CUDA and Triton kernels against
torch.nn.EmbeddingBag with sparse gradients and the same update in plain PyTorch, eager and with
the forward under torch.compile, and a device copy of the bytes the step must move
(bench/bench_embedding_bag.py builds the batch, the tables and every provider's step; this module
only times them with device events and checks them first).

The CUDA backend runs once per variant of the fused update (family "embedding_update":
warp_per_row, batched_ids; recxla/embedding_update_lanes.h), as `recxla-cuda:<variant>`; the
winner is the variant with the least summed median over the two key distributions, recorded as
the module's choice (in the dry run the C++ CPU op stands in for every variant).

Check: before timing, each recxla backend's pooled forward on the batch must equal
torch.nn.functional.embedding_bag over the same weights (float32 sums in another order: close,
relative 1e-5), and its update must change exactly the rows the batch touches; every variant
after the first must leave the tables and optimizer states of one step bit for bit as the first
does.

Bytes (`step_bytes`): every id's row read in the forward and its gradient row read in the
backward, the pooled output written and its gradient read, every unique row read and written by
the update: at batch 8192, dim 64, ~700k ids and ~140k unique rows, about 0.5 GB, so about
0.2 ms of HBM time on an H100. The step ran in 12-14 ms there (bench/results/gpu.md, first run):
the host work per call dominates, which a torch.profiler trace of this stage would show.
"""

import contextlib
import os
import time
from typing import Dict, List, Optional

import torch

from bench.gpu_campaign.timing import (
    DEVICE_COPY, Guard, backend, choice, copy_fn, failed_row, least_summed_median,
    medians_by_group, row, time_calls,
)

FAMILY = "embedding_update"
GROUP = "embedding-bag step (fwd+bwd+rowwise adagrad), batch 8192, dim 64"


def _setup(dry_run: bool):
    if dry_run:  # small tables and the CPU: the code path, not the figures
        os.environ.setdefault("RECXLA_BENCH_ROWS", "2000")
    from bench import bench_embedding_bag as eb

    return eb


def _check_forward(eb, kjt, device: str) -> str:
    """The recxla module's forward against torch's embedding_bag on the same weights."""
    from recxla.nn import EmbeddingBagCollection

    module = EmbeddingBagCollection(eb.tables(), optimizer="rowwise_adagrad", lr=eb.LR,
                                    eps=eb.EPS, device=torch.device(device))
    got = module(kjt).values().detach()
    weights = [p.detach() for p in module.parameters()]
    want = []
    for w, f in zip(weights, kjt.to_dict().values()):
        want.append(torch.nn.functional.embedding_bag(f.values().long(), w, f.offsets().long(),
                                                      mode="sum", include_last_offset=True))
    want = torch.cat(want, dim=1)
    error = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    if not error <= 1e-5:
        return f"FAILED: forward differs from torch's embedding_bag, relative error {error:.2e}"
    before = [w.clone() for w in weights]
    module(kjt).values().backward(torch.randn_like(got))
    for t, (w, b, f) in enumerate(zip(weights, before, kjt.to_dict().values())):
        changed = (w != b).any(dim=1)
        touched = torch.zeros_like(changed)
        touched[f.values().long()] = True
        if bool((changed & ~touched).any()):
            return f"FAILED: the update changed rows of table {t} that the batch does not touch"
    return "close"


def _one_step(eb, kjt, device: str) -> List[torch.Tensor]:
    """The tables and optimizer states after one step from fixed weights and gradient."""
    from recxla.nn import EmbeddingBagCollection

    torch.manual_seed(0)
    module = EmbeddingBagCollection(eb.tables(), optimizer="rowwise_adagrad", lr=eb.LR,
                                    eps=eb.EPS, device=torch.device(device))
    out = module(kjt).values()
    out.backward(torch.randn_like(out))
    return [t.detach().clone() for t in module.state_dict().values()]


def _check_variant(eb, kjt, device: str, variant: Optional[str], first: str,
                   compare: bool) -> str:
    """The forward check, then (`compare`) one step under `variant` against one under
    `first`."""
    from recxla.ops import gpu_variants

    check = _check_forward(eb, kjt, device)
    if check.startswith("FAILED") or not compare or variant in (None, first):
        return check
    with gpu_variants.use_variant(FAMILY, first):
        want = _one_step(eb, kjt, device)
    with gpu_variants.use_variant(FAMILY, variant):
        got = _one_step(eb, kjt, device)
    if len(got) != len(want) or not all(torch.equal(g, w) for g, w in zip(got, want)):
        return f"FAILED: one step leaves other tables or states than {first}'s"
    return f"close; one step equals {first}'s bit for bit"


@contextlib.contextmanager
def _provider_context(which: Optional[str], variant: Optional[str]):
    """The backend (None: the default one) and, given, the fused update's variant."""
    from recxla.ops import gpu_variants

    with backend(which), (gpu_variants.use_variant(FAMILY, variant) if variant
                          else contextlib.nullcontext()):
        yield


def _providers(device: str) -> Dict[str, tuple]:
    """name -> (provider, backend, variant of the fused update)."""
    from recxla.ops import gpu_variants

    providers: Dict[str, tuple] = {}
    for variant in gpu_variants.variants(FAMILY):
        # On the CPU (the dry run) the C++ op stands in for every variant.
        providers[f"recxla-cuda:{variant}"] = ("recxla", "cuda" if device == "cuda" else None,
                                                variant)
    if device == "cuda":
        providers["recxla-triton"] = ("recxla", "triton", None)
    providers["torch"] = ("torch", None, None)
    return providers


def _choices(rows: List[dict], device: str, dry_run: bool, began: float) -> list:
    """The winner: the variant with the least summed median over the distributions timed (it
    must have passed and been timed in each)."""
    from recxla.ops import gpu_variants

    variants = gpu_variants.variants(FAMILY)
    groups = sorted({r["group"] for r in rows})
    winner = least_summed_median(rows, variants, groups, prefix="recxla-cuda:")
    if winner is None:
        return []

    def figures(variant):
        got = medians_by_group(rows, f"recxla-cuda:{variant}")
        return " / ".join(f"{got[g] / 1e3:.2f}" if g in got else "n/a" for g in groups) + " ms"

    names = " / ".join(g.split(", ")[-1] for g in groups)
    others = "; ".join(f"{v} {figures(v)}" for v in variants if v != winner)
    why = (f"{winner} took {figures(winner)} a step ({names}, median) against "
           f"{others or 'no other variant'}")
    return [choice(FAMILY, winner, why, device, dry_run, began)]


def _first_variant() -> str:
    from recxla.ops import gpu_variants

    return gpu_variants.variants(FAMILY)[0]


def run(device: str, dry_run: bool) -> dict:
    eb = _setup(dry_run)
    began_module = time.monotonic()
    iters = 3 if dry_run else 20
    rows: List[dict] = []
    guard = Guard(device)
    first = _first_variant()
    distributions = ["zipf-1.05"] if dry_run else ["zipf-1.05", "iid-uniform"]
    for distribution in distributions:
        kjts = [k.to(torch.device(device)) for k in eb.batches(distribution)]
        n_unique = int(torch.unique(kjts[0].values()).numel())
        nbytes = eb.step_bytes(kjts, n_unique)
        group = f"{GROUP}, {distribution}"
        fn, pairs = copy_fn(nbytes // 2, device)
        copied = time_calls(fn, pairs, iters=iters, device=device)
        copy_us = copied["median_us"]
        rows.append(row(group, DEVICE_COPY, copied, nbytes, copy_us, check="baseline"))
        providers = _providers(device)
        if not dry_run:
            providers["torch-compile"] = ("torch-compile", None, None)
        for name, (provider, which, variant) in providers.items():
            with _provider_context(which, variant):
                # One step's bits are compared on the first distribution only (each comparison
                # builds the tables twice).
                check, error = guard(f"{name} check", lambda: _check_variant(
                    eb, kjts[0], device, variant, first, distribution == distributions[0])
                    if provider == "recxla" else "baseline")
                check = error or check
                if check.startswith("FAILED"):
                    rows.append(failed_row(group, name, check))
                    continue
                step, error = guard(f"{name} setup",
                                    lambda: eb.make_step(provider, "rowwise_adagrad", device))
                if error:
                    rows.append(failed_row(group, name, error))
                    continue
                began = time.perf_counter()
                timing, error = guard(name, lambda: time_calls(
                    step, [(k,) for k in kjts], warmup=3, iters=iters, device=device))
                rows.append(failed_row(group, name, error) if error else row(
                    group, name, timing, nbytes, copy_us, check=check,
                    wall_s=round(time.perf_counter() - began, 2)))
        eb._model.clear()
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "choices": _choices(rows, device, dry_run, began_module)}
