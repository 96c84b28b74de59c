"""pytest-benchmark: one training step of the sparse part (pooled lookup forward, backward and
the optimizer update of the touched rows) on a Criteo-like batch, on 1 and on 2 threads.

    RECXLA_BENCH_MALLOC=default .venv/bin/python -m pytest bench/bench_embedding_bag.py \
        --benchmark-only --benchmark-json=/tmp/embedding_bag_default.json
    .venv/bin/python -m pytest bench/bench_embedding_bag.py --benchmark-only \
        --benchmark-json=/tmp/embedding_bag_tuned.json        # freed memory kept (conftest)
    .venv/bin/python bench/bench_embedding_bag.py /tmp/embedding_bag_default.json \
        /tmp/embedding_bag_tuned.json                           # markdown tables

Batch: recxla.data.SyntheticRankingDataset, 8192 samples, 26 features with Criteo Kaggle's table
sizes capped at 1M rows (RECXLA_BENCH_ROWS), dim 64 (RECXLA_BENCH_DIM): 21 one-hot features,
a user history of 10-100 ids and item tags of 1-5, about 700k ids per batch, user-side features
repeated over the candidates of a request. Key laws: the dataset's Zipf exponents 1.05 and 1.2,
its uniform law (0.0, requests still repeat user features), and `iid-uniform`: the same bag
lengths with every id drawn independently and uniformly over its table (the fewest repeats, the
worst case for dedup). Three batches are cycled.

Providers (same tables, same optimizer, one step = forward + backward + update, every one at
the test's thread count, torch.set_num_threads):
- recxla: recxla.nn.EmbeddingBagCollection, dedup + fused C++ kernels (weights get no .grad);
- fbgemm-tbe: FBGEMM's SplitTableBatchedEmbeddingBagsCodegen on CPU (EmbeddingLocation.HOST,
  ComputeDevice.CPU) with EXACT_SGD or EXACT_ROWWISE_ADAGRAD, the fused upstream path. Its CPU
  SGD backward runs one thread whatever the setting, and its row-wise Adagrad kernel is slow on
  CPU: ratios against it measure FBGEMM's CPU kernels, not a limit of the method;
- torch: plain PyTorch as a user writes it: 26 torch.nn.EmbeddingBag(sparse=True), a cat, and
  torch.optim.SGD on the sparse gradients; for row-wise Adagrad (torch has none) the update
  written the obvious way on the coalesced sparse gradient (`rowwise_adagrad_`);
- torch-compile: the same with the model's forward under torch.compile (Inductor; the sparse
  backward and the optimizer stay eager: Inductor has no sparse kernels to generate);
- memcpy: a copy of the bytes a step must move at least (see `step_bytes`).
`test_embedding_bag_forward_cpu` times the forward alone (no_grad) against FBGEMM's TBE and
TorchRec's unsharded EmbeddingBagCollection (torch.nn.EmbeddingBag per table, then a cat), eager
and under torch.compile.
Providers run interleaved: each round times every provider once, in an order that rotates, so
that the other jobs of a shared machine slow them alike; extra_info holds each provider's
median_ms, min_ms and median_faults (minor page faults per step) and threads, allocator, n_ids,
n_unique, bytes, memcpy_gbps, recxla_of_memcpy; pytest-benchmark's own columns time whole rounds.
"""

import json
import os
import resource
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.common import gbps, memcpy_fn  # noqa: E402

BATCH = 8192
DIM = int(os.environ.get("RECXLA_BENCH_DIM", "64"))
MAX_ROWS = int(os.environ.get("RECXLA_BENCH_ROWS", "1000000"))
LR, EPS = 0.01, 1e-8
DISTRIBUTIONS = {"zipf-1.05": 1.05, "zipf-1.2": 1.2, "uniform": 0.0, "iid-uniform": None}
OPTIMIZERS = ["sgd", "rowwise_adagrad"]
PROVIDERS = ["recxla", "fbgemm-tbe", "torch", "torch-compile", "memcpy"]
THREADS = [1, 2]
# bench/conftest.py keeps freed memory in the process unless RECXLA_BENCH_MALLOC=default.
ALLOCATOR = "default" if os.environ.get("RECXLA_BENCH_MALLOC") == "default" else "tuned"

_batches: Dict[str, list] = {}
_model: Dict[str, object] = {}  # the models of the running group of tests


def profile(exponent):
    from recxla.data.profiles import criteo_kaggle_profile

    return criteo_kaggle_profile(zipf=exponent if exponent is not None else 0.0, max_rows=MAX_ROWS)


def batches(distribution: str) -> list:
    """Three KeyedJaggedTensors of the distribution (generated once per process)."""
    if distribution not in _batches:
        from torchrec import KeyedJaggedTensor

        from recxla.data.synthetic import SyntheticRankingDataset

        exponent = DISTRIBUTIONS[distribution]
        p = profile(exponent)
        data = SyntheticRankingDataset(p, batch_size=BATCH, seed=0)
        kjts = [data.batch(i).sparse for i in range(3)]
        if exponent is None:
            g = torch.Generator().manual_seed(1)
            kjts = [
                KeyedJaggedTensor(
                    keys=k.keys(), lengths=k.lengths(),
                    values=torch.cat([torch.randint(0, rows, (n,), generator=g)
                                      for rows, n in zip(p.num_embeddings, k.length_per_key())]),
                )
                for k in kjts
            ]
        _batches[distribution] = kjts
    return _batches[distribution]


def tables():
    from recxla.data.profiles import embedding_bag_configs

    return embedding_bag_configs(profile(1.05), embedding_dim=DIM, max_rows=MAX_ROWS)


def rowwise_adagrad_(weight: torch.nn.Parameter, state: torch.Tensor, lr: float,
                     eps: float) -> None:
    """FBGEMM's EXACT_ROWWISE_ADAGRAD (no weight decay) in plain PyTorch, on weight's sparse
    gradient: per touched row m += mean(g^2), w -= lr * g / (sqrt(m) + eps). state: [E]."""
    grad = weight.grad.coalesce()
    rows, values = grad.indices()[0], grad.values()
    state.index_add_(0, rows, values.pow(2).mean(dim=1))
    multiplier = lr / (state[rows].sqrt() + eps)
    weight.data.index_add_(0, rows, values * -multiplier[:, None])


def make_step(provider: str, optimizer: str, device: str = "cpu"):
    """A function kjt -> None running one step of `provider` on `device` (kjt already there);
    models are built once and kept while the same (provider, optimizer, device) runs."""
    key = f"{provider}/{device}/{optimizer}"
    if key in _model:
        return _model[key]
    if not all(k.endswith(f"/{device}/{optimizer}") for k in _model):
        _model.clear()  # one optimizer's models alive at a time: the tables take GBs each
    grad = torch.randn(BATCH, 26 * DIM, device=device)
    if provider == "recxla":
        from recxla.nn import EmbeddingBagCollection

        kwargs = {"lr": LR, "eps": EPS} if optimizer == "rowwise_adagrad" else {"lr": LR}
        module = EmbeddingBagCollection(tables(), optimizer=optimizer, device=torch.device(device),
                                        **kwargs)

        def step(kjt):
            module(kjt).values().backward(grad)

    elif provider == "fbgemm-tbe":
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen,
        )

        optim = EmbOptimType.EXACT_ROWWISE_ADAGRAD if optimizer == "rowwise_adagrad" \
            else EmbOptimType.EXACT_SGD
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(t.num_embeddings, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in tables()],
            optimizer=optim, learning_rate=LR, eps=EPS, pooling_mode=PoolingMode.SUM,
        )

        def step(kjt):
            tbe(kjt.values(), kjt.offsets().long()).backward(grad)

    elif provider in ("torch", "torch-compile"):
        # Both providers train the same tables (one copy of the GBs).
        bags = _model.get(f"bags/{device}/{optimizer}") or [
            torch.nn.EmbeddingBag(t.num_embeddings, DIM, mode="sum", sparse=True,
                                  include_last_offset=True, device=device) for t in tables()]
        _model[f"bags/{device}/{optimizer}"] = bags
        params = [b.weight for b in bags]

        def forward(values, offsets):
            return torch.cat([bag(v, o) for bag, v, o in zip(bags, values, offsets)], dim=1)

        if provider == "torch-compile":
            forward = torch.compile(forward)
        if optimizer == "sgd":
            sgd = torch.optim.SGD(params, lr=LR)
            update = sgd.step
        else:
            states = [torch.zeros(p.shape[0], device=device) for p in params]

            def update():
                for p, s in zip(params, states):
                    rowwise_adagrad_(p, s, LR, EPS)

        def step(kjt):
            for p in params:
                p.grad = None
            features = kjt.to_dict().values()
            # int64 offsets like the ids (the batch's lengths are int32; Inductor's embedding_bag
            # wants one index dtype; 26 x 8193 values, nothing next to the step)
            forward([f.values() for f in features],
                    [f.offsets().long() for f in features]).backward(grad)
            with torch.no_grad():
                update()

    else:
        raise ValueError(provider)
    _model[key] = step
    return step


def step_bytes(kjts, n_unique: int) -> int:
    """Bytes a step moves at least: each id's row read in the forward and its output-gradient
    row read in the backward, the pooled output written and its gradient read, each unique row
    read and written once by the update."""
    n_ids = kjts[0].values().numel()
    row = DIM * 4
    return 2 * n_ids * row + 2 * BATCH * 26 * row + 2 * n_unique * row


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleaved(benchmark, steps: Dict[str, Callable[[int], object]], rounds: int,
                warmup: int) -> Dict[str, List[tuple]]:
    """Times every provider once per round, in an order that rotates from round to round, so
    that load from other processes lands on all of them alike. Returns (seconds, minor page
    faults) per provider and timed round. pytest-benchmark's own statistics are those of whole
    rounds."""
    names = list(steps)
    times: Dict[str, List[tuple]] = {name: [] for name in names}
    counter = iter(range(10**9))
    if benchmark.disabled:  # --benchmark-disable: one round, run to check, not to time
        warmup = 0

    def one_round():
        r = next(counter)
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            faults, start = minor_faults(), time.perf_counter()
            steps[name](r)
            if r >= warmup:
                times[name].append((time.perf_counter() - start, minor_faults() - faults))

    benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=warmup)
    return times


def record(benchmark, times: Dict[str, List[tuple]], **extra) -> None:
    """Per provider into extra_info: median and minimum ms, median minor page faults (first
    touches of fresh memory: about 3 us each on these machines)."""
    benchmark.extra_info.update(extra)
    for key, pick, scale in (("median_ms", statistics.median, 1e3), ("min_ms", min, 1e3)):
        benchmark.extra_info[key] = {k: round(pick(s for s, _ in v) * scale, 2)
                                     for k, v in times.items()}
    benchmark.extra_info["median_faults"] = {k: int(statistics.median(f for _, f in v))
                                             for k, v in times.items()}


@pytest.mark.parametrize("threads", THREADS, indirect=True)
@pytest.mark.parametrize("distribution", list(DISTRIBUTIONS))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_embedding_bag_step_cpu(benchmark, optimizer, distribution, threads):
    """One step of every provider per round (3 warm-up rounds: each batch once, and
    torch.compile's recompile for dynamic shapes), 7 timed rounds."""
    from recxla.ops.dedup import segmented_unique

    kjts = batches(distribution)
    lengths = torch.tensor(kjts[0].length_per_key())
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n_unique = segmented_unique(kjts[0].values(), bounds)[0].numel()
    nbytes = step_bytes(kjts, n_unique)
    steps = {p: (lambda r, step=make_step(p, optimizer): step(kjts[r % 3]))
             for p in PROVIDERS if p != "memcpy"}
    copy = memcpy_fn(nbytes // 2)
    steps["memcpy"] = lambda r: copy()
    times = interleaved(benchmark, steps, rounds=10, warmup=3)
    memcpy_s = statistics.median(s for s, _ in times["memcpy"])
    recxla_s = statistics.median(s for s, _ in times["recxla"])
    record(benchmark, times, n_ids=kjts[0].values().numel(), n_unique=n_unique, bytes=nbytes,
           dim=DIM, threads=threads, allocator=ALLOCATOR,
           memcpy_gbps=round(gbps(nbytes, memcpy_s), 2),
           recxla_of_memcpy=round(memcpy_s / recxla_s, 3))


FORWARD_PROVIDERS = ["recxla", "fbgemm-tbe", "torchrec-ebc", "torchrec-ebc-compile"]


def make_forward(provider: str):
    """kjt -> pooled [B, 26 * DIM] under no_grad, for the forward-only comparison."""
    key = f"{provider}/forward"
    if key in _model:
        return _model[key]
    if provider == "recxla":
        from recxla.nn import EmbeddingBagCollection

        module = EmbeddingBagCollection(tables())
        fn = lambda kjt: module(kjt).values()  # noqa: E731
    elif provider.startswith("torchrec-ebc"):
        from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecEBC

        module = _model.get("torchrec-ebc/module")
        if module is None:
            module = TorchRecEBC(tables())
        _model["torchrec-ebc/module"] = module
        if provider.endswith("compile"):
            module = torch.compile(module)
        fn = lambda kjt: module(kjt).values()  # noqa: E731
    else:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen,
        )

        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(t.num_embeddings, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in tables()],
            pooling_mode=PoolingMode.SUM,
        )
        fn = lambda kjt: tbe(kjt.values(), kjt.offsets().long())  # noqa: E731

    def forward(kjt):
        with torch.no_grad():
            return fn(kjt)

    _model[key] = forward
    return forward


@pytest.mark.parametrize("threads", THREADS, indirect=True)
@pytest.mark.parametrize("distribution", ["zipf-1.05", "iid-uniform"])
def test_embedding_bag_forward_cpu(benchmark, distribution, threads):
    """The forward alone (dedup included for recxla), providers interleaved as in the step."""
    if not any(k.endswith("/forward") for k in _model):
        _model.clear()  # the step's models: one group alive at a time
    kjts = batches(distribution)
    steps = {p: (lambda r, fn=make_forward(p): fn(kjts[r % 3])) for p in FORWARD_PROVIDERS}
    times = interleaved(benchmark, steps, rounds=10, warmup=3)
    record(benchmark, times, n_ids=kjts[0].values().numel(), dim=DIM, threads=threads,
           allocator=ALLOCATOR)


GPU_PROVIDERS = ["recxla-cuda", "recxla-triton", "torch", "torch-compile"]


@pytest.mark.gpu
@pytest.mark.parametrize("distribution", ["zipf-1.05", "iid-uniform"])
@pytest.mark.parametrize("provider", GPU_PROVIDERS)
def test_embedding_bag_step_gpu(benchmark, monkeypatch, provider, distribution):
    """Forward + backward + row-wise Adagrad on one GPU: recxla's CUDA and Triton kernels
    against torch.nn.EmbeddingBag (sparse gradients, the same update in plain PyTorch) eager and
    compiled. FBGEMM's CUDA TBE is the peer a user would pick where its CUDA build is installed."""
    if provider.startswith("recxla-"):
        monkeypatch.setenv("RECXLA_BACKEND", provider.split("-")[1])
        step = make_step("recxla", "rowwise_adagrad", "cuda")
    else:
        step = make_step(provider, "rowwise_adagrad", "cuda")
    kjts = [k.to(torch.device("cuda")) for k in batches(distribution)]
    counter = iter(range(10**9))

    def run():
        step(kjts[next(counter) % 3])
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=20, iterations=1, warmup_rounds=3)


def _medians(path: str, test: str, fields, key: str = "median_ms") -> Dict[tuple, dict]:
    """{params of `fields`: {provider: extra_info[key]}} of the tests named `test`."""
    with open(path) as f:
        runs = json.load(f)["benchmarks"]
    return {tuple(r["params"][k] for k in fields): r["extra_info"].get(key, {})
            for r in runs if r["name"].startswith(test)}


def _ms(value: Optional[float]) -> str:
    return f"{value:.1f}" if value is not None else "-"


def _ratio(slow: Optional[float], fast: Optional[float]) -> str:
    return f"{slow / fast:.2f}x" if slow and fast else "-"


def summarize(default_path: str, tuned_path: Optional[str] = None) -> str:
    """Markdown tables of two --benchmark-json files (default allocator, then tuned): median ms
    per provider, and recxla's speedups, each from one run at one thread count."""
    fields = ("optimizer", "distribution", "threads")
    default = _medians(default_path, "test_embedding_bag_step_cpu", fields)
    tuned = _medians(tuned_path, "test_embedding_bag_step_cpu", fields) if tuned_path else {}
    lines: List[str] = [
        "| optimizer | keys | threads | recxla | fbgemm-tbe | torch | torch-compile | memcpy | "
        "vs fbgemm-tbe | vs torch | vs torch-compile | tuned: recxla | tuned: fbgemm-tbe | "
        "tuned: vs fbgemm-tbe |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in OPTIMIZERS:
        for d in DISTRIBUTIONS:
            for t in THREADS:
                m = default.get((o, d, t))
                if m is None:
                    continue
                row = [m.get(p) for p in PROVIDERS]
                tm = tuned.get((o, d, t), {})
                tr, tt = tm.get("recxla"), tm.get("fbgemm-tbe")
                cells = [_ms(v) for v in row] + [_ratio(row[i], row[0]) for i in (1, 2, 3)]
                cells += [_ms(tr), _ms(tt), _ratio(tt, tr)]
                lines.append(f"| {o} | {d} | {t} | " + " | ".join(cells) + " |")
    faults = _medians(default_path, "test_embedding_bag_step_cpu", fields, "median_faults")
    if any(faults.values()):
        lines += ["", "| minor page faults per step | keys | threads | "
                  + " | ".join(PROVIDERS[:-1]) + " |", "|---|---|---|" + "---|" * 4]
        for (o, d, t), m in faults.items():
            if m:
                lines.append(f"| {o} | {d} | {t} | " + " | ".join(
                    str(m.get(p, "-")) for p in PROVIDERS[:-1]) + " |")
    forward = _medians(default_path, "test_embedding_bag_forward_cpu", ("distribution", "threads"))
    if forward:
        lines += ["", "| forward only | threads | " + " | ".join(FORWARD_PROVIDERS) + " |",
                  "|---|---|" + "---|" * len(FORWARD_PROVIDERS)]
        for (d, t), m in sorted(forward.items()):
            lines.append(f"| {d} | {t} | " + " | ".join(_ms(m.get(p)) for p in FORWARD_PROVIDERS)
                         + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(*sys.argv[1:3]))
