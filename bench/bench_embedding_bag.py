"""pytest-benchmark: one training step of the sparse part (pooled lookup forward, backward and
the optimizer update of the touched rows) on a Criteo-like batch.

    .venv/bin/python -m pytest bench/bench_embedding_bag.py --benchmark-only \
        --benchmark-columns=min,median,mean,rounds --benchmark-json=/tmp/embedding_bag.json
    .venv/bin/python bench/bench_embedding_bag.py /tmp/embedding_bag.json   # markdown table

Batch: recxla.data.SyntheticRankingDataset, 8192 samples, 26 features with Criteo Kaggle's table
sizes capped at 1M rows (RECXLA_BENCH_ROWS), dim 64 (RECXLA_BENCH_DIM): 21 one-hot features,
a user history of 10-100 ids and item tags of 1-5, about 700k ids per batch, user-side features
repeated over the candidates of a request. Key laws: the dataset's Zipf exponents 1.05 and 1.2,
its uniform law (0.0, requests still repeat user features), and `iid-uniform`: the same bag
lengths with every id drawn independently and uniformly over its table (almost no repeats, the
worst case for dedup). Three batches are cycled.

Providers (same tables, same optimizer, one step = forward + backward + update):
- recxla: recxla.nn.EmbeddingBagCollection, dedup + fused C++ kernels (weights get no .grad);
- fbgemm-tbe: FBGEMM's SplitTableBatchedEmbeddingBagsCodegen on CPU (EmbeddingLocation.HOST,
  ComputeDevice.CPU) with EXACT_ROWWISE_ADAGRAD or EXACT_SGD, the fused upstream path;
- torch-sparse: 26 torch.nn.EmbeddingBag(sparse=True) and torch's sparse optimizer
  (SGD for sgd; torch has no row-wise Adagrad, so Adagrad, per element, for rowwise_adagrad);
- reference: recxla.reference.embedding_bag (plain PyTorch ops) after recxla's dedup;
- memcpy: a copy of the bytes a step must move at least (see `step_bytes`).
`test_embedding_bag_forward_cpu` times the forward alone (no_grad) against FBGEMM's TBE and
TorchRec's unsharded EmbeddingBagCollection (torch.nn.EmbeddingBag per table, then a cat).
extra_info: n_ids, n_unique, bytes, gbps, memcpy_gbps, of_memcpy (bench/common.py).
"""

import json
import os
import sys
from typing import Dict, List

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.common import gbps, memcpy_fn, memcpy_gbps  # noqa: E402

BATCH = 8192
DIM = int(os.environ.get("RECXLA_BENCH_DIM", "64"))
MAX_ROWS = int(os.environ.get("RECXLA_BENCH_ROWS", "1000000"))
LR, EPS = 0.01, 1e-8
DISTRIBUTIONS = {"zipf-1.05": 1.05, "zipf-1.2": 1.2, "uniform": 0.0, "iid-uniform": None}
OPTIMIZERS = ["rowwise_adagrad", "sgd"]
PROVIDERS = ["recxla", "fbgemm-tbe", "torch-sparse", "reference", "memcpy"]
ROUNDS = {"reference": 2, "torch-sparse": 3}

_batches: Dict[str, list] = {}
_model: Dict[str, object] = {}  # one model alive at a time: the tables take GBs


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
        _batches.clear()  # one distribution at a time
        _batches[distribution] = kjts
    return _batches[distribution]


def tables():
    from recxla.data.profiles import embedding_bag_configs

    return embedding_bag_configs(profile(1.05), embedding_dim=DIM, max_rows=MAX_ROWS)


def make_step(provider: str, optimizer: str):
    """A function kjt -> None running one step of `provider`; models are built once and kept
    while the same (provider, optimizer) runs."""
    key = f"{provider}/{optimizer}"
    if key in _model:
        return _model[key]
    _model.clear()
    grad = torch.randn(BATCH, 26 * DIM)
    if provider == "recxla":
        from recxla.nn import EmbeddingBagCollection

        kwargs = {"lr": LR, "eps": EPS} if optimizer == "rowwise_adagrad" else {"lr": LR}
        module = EmbeddingBagCollection(tables(), optimizer=optimizer, **kwargs)

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

    elif provider == "torch-sparse":
        bags = [torch.nn.EmbeddingBag(t.num_embeddings, DIM, mode="sum", sparse=True,
                                      include_last_offset=True) for t in tables()]
        params = [b.weight for b in bags]
        opt = torch.optim.SGD(params, lr=LR) if optimizer == "sgd" else \
            torch.optim.Adagrad(params, lr=LR, eps=EPS)

        def step(kjt):
            opt.zero_grad()
            outs = [bag(f.values(), f.offsets()) for bag, f in zip(bags, kjt.to_dict().values())]
            torch.cat(outs, dim=1).backward(grad)
            opt.step()

    elif provider == "reference":
        from recxla.nn import EmbeddingBagCollection
        from recxla.ops.dedup import segmented_unique
        from recxla.reference import embedding_bag as ref

        module = EmbeddingBagCollection(tables())
        weights = [p.detach() for p in module.parameters()]
        kind = ref.ROWWISE_ADAGRAD if optimizer == "rowwise_adagrad" else ref.SGD
        states = [torch.zeros(w.shape[0]) for w in weights]

        def step(kjt):
            values, offsets, psw, bounds = module._table_major_ids(kjt)
            uv, uo, inv = segmented_unique(values, bounds)
            args = (uv, uo, inv, offsets, psw, module._feature_table, module._pooling, BATCH)
            ref.embedding_bag_forward_ref(weights, *args)
            ref.embedding_bag_backward_update_ref(grad, weights, states, *args, [kind] * 26,
                                                  [LR, EPS, 0.0, 1.0] * 26)

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


CASES = [(o, d, p) for o in OPTIMIZERS for p in PROVIDERS for d in DISTRIBUTIONS
         if not (p == "reference" and d != "zipf-1.05")]


@pytest.mark.parametrize("optimizer,distribution,provider", CASES)
def test_embedding_bag_step_cpu(benchmark, optimizer, distribution, provider):
    from recxla.ops.dedup import segmented_unique

    kjts = batches(distribution)
    lengths = torch.tensor(kjts[0].length_per_key())
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n_unique = segmented_unique(kjts[0].values(), bounds)[0].numel()
    nbytes = step_bytes(kjts, n_unique)
    reference_gbps = memcpy_gbps(nbytes // 2)
    if provider == "memcpy":
        copy = memcpy_fn(nbytes // 2)
        benchmark.pedantic(copy, rounds=5, iterations=1, warmup_rounds=1)
    else:
        step = make_step(provider, optimizer)
        counter = iter(range(10**9))
        benchmark.pedantic(lambda: step(kjts[next(counter) % 3]),
                           rounds=ROUNDS.get(provider, 5), iterations=1, warmup_rounds=2)
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        n_ids=kjts[0].values().numel(), n_unique=n_unique, bytes=nbytes, dim=DIM,
        threads=torch.get_num_threads(), gbps=round(gbps(nbytes, median), 2),
        memcpy_gbps=round(reference_gbps, 2), of_memcpy=round(gbps(nbytes, median) / reference_gbps, 3),
    )


def make_forward(provider: str):
    """kjt -> pooled [B, 26 * DIM] under no_grad, for the forward-only comparison."""
    key = f"{provider}/forward"
    if key in _model:
        return _model[key]
    _model.clear()
    if provider == "recxla":
        from recxla.nn import EmbeddingBagCollection

        module = EmbeddingBagCollection(tables())
        fn = lambda kjt: module(kjt).values()  # noqa: E731
    elif provider == "torchrec-ebc":
        from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecEBC

        module = TorchRecEBC(tables())
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


@pytest.mark.parametrize("provider", ["recxla", "fbgemm-tbe", "torchrec-ebc"])
@pytest.mark.parametrize("distribution", ["zipf-1.05", "iid-uniform"])
def test_embedding_bag_forward_cpu(benchmark, distribution, provider):
    """The forward alone (dedup included for recxla): where the step's time is not spent."""
    kjts = batches(distribution)
    forward = make_forward(provider)
    counter = iter(range(10**9))
    out = benchmark.pedantic(lambda: forward(kjts[next(counter) % 3]), rounds=5, iterations=1,
                             warmup_rounds=1)
    assert out.shape == (BATCH, 26 * DIM)
    benchmark.extra_info.update(n_ids=kjts[0].values().numel(), dim=DIM)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("distribution", ["zipf-1.05", "iid-uniform"])
def test_embedding_bag_step_gpu(benchmark, monkeypatch, backend, distribution):
    from recxla.nn import EmbeddingBagCollection

    monkeypatch.setenv("RECXLA_BACKEND", backend)
    device = torch.device("cuda")
    kjts = [k.to(device) for k in batches(distribution)]
    module = EmbeddingBagCollection(tables(), device=device, optimizer="rowwise_adagrad", lr=LR,
                                    eps=EPS)
    grad = torch.randn(BATCH, 26 * DIM, device=device)
    counter = iter(range(10**9))

    def step():
        module(kjts[next(counter) % 3]).values().backward(grad)
        torch.cuda.synchronize()

    benchmark.pedantic(step, rounds=10, iterations=1, warmup_rounds=2)


def summarize(path: str) -> str:
    """A markdown table of a --benchmark-json file: median ms per provider and recxla's speedup."""
    with open(path) as f:
        runs = json.load(f)["benchmarks"]
    median: Dict[tuple, float] = {}
    for r in runs:
        p = r["params"]
        if r["name"].startswith("test_embedding_bag_step_cpu"):
            median[(p["optimizer"], p["distribution"], p["provider"])] = r["stats"]["median"] * 1e3
    lines: List[str] = [
        "| optimizer | keys | recxla ms | fbgemm-tbe ms | torch-sparse ms | reference ms | "
        "memcpy ms | vs fbgemm | vs torch-sparse |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for o in OPTIMIZERS:
        for d in DISTRIBUTIONS:
            row = [median.get((o, d, p)) for p in PROVIDERS]
            if row[0] is None:
                continue
            cells = [f"{v:.1f}" if v is not None else "-" for v in row]
            speed = [f"{row[i] / row[0]:.2f}x" if row[i] else "-" for i in (1, 2)]
            lines.append(f"| {o} | {d} | " + " | ".join(cells + speed) + " |")
    forward = {}
    for r in runs:
        if r["name"].startswith("test_embedding_bag_forward_cpu"):
            p = r["params"]
            forward[(p["distribution"], p["provider"])] = r["stats"]["median"] * 1e3
    if forward:
        lines += ["", "| forward only | recxla ms | fbgemm-tbe ms | torchrec-ebc ms |",
                  "|---|---|---|---|"]
        for d in DISTRIBUTIONS:
            row = [forward.get((d, p)) for p in ("recxla", "fbgemm-tbe", "torchrec-ebc")]
            if row[0] is not None:
                lines.append(f"| {d} | " + " | ".join(
                    f"{v:.1f}" if v is not None else "-" for v in row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1]))
