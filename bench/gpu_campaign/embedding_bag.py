"""Campaign stage: one training step of the sparse part on a GPU (pooled lookup forward,
backward and the fused row-wise Adagrad update), recxla's CUDA and Triton kernels against
torch.nn.EmbeddingBag with sparse gradients and the same update in plain PyTorch, eager and with
the forward under torch.compile, and a device copy of the bytes the step must move
(bench/bench_embedding_bag.py builds the batch, the tables and every provider's step; this module
only times them with device events and checks them first).

Check: before timing, each recxla backend's pooled forward on the batch must equal
torch.nn.functional.embedding_bag over the same weights (float32 sums in another order: close,
relative 1e-5), and its update must change exactly the rows the batch touches.

Bytes (`step_bytes`): every id's row read in the forward and its gradient row read in the
backward, the pooled output written and its gradient read, every unique row read and written by
the update: at batch 8192, dim 64, ~700k ids and ~140k unique rows, about 0.5 GB, so about
0.2 ms of HBM time on an H100. The step ran in 12-14 ms there (bench/results/gpu.md, first run):
the host work per call dominates, which a torch.profiler trace of this stage would show.
"""

import os
import time
from typing import Dict, List

import torch

from bench.gpu_campaign.timing import (
    DEVICE_COPY, Guard, backend, copy_fn, failed_row, row, time_calls,
)

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


def run(device: str, dry_run: bool) -> dict:
    eb = _setup(dry_run)
    iters = 3 if dry_run else 20
    rows: List[dict] = []
    guard = Guard(device)
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
        providers: Dict[str, tuple] = {}
        for name in (["cuda", "triton"] if device == "cuda" else ["cpu"]):
            providers[f"recxla-{name}"] = ("recxla", name)
        providers["torch"] = ("torch", None)
        if not dry_run:
            providers["torch-compile"] = ("torch-compile", None)
        for name, (provider, which) in providers.items():
            with backend(which if which in ("cuda", "triton") else None):
                check, error = guard(f"{name} check", lambda: _check_forward(eb, kjts[0], device)
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
    return {"rows": rows, "choices": []}
