"""Key-centric sample clustering on the synthetic ranking log: unique keys per micro-batch, and
what clustering and data generation cost next to an embedding lookup of the same batch.

Two entry points:

    .venv/bin/python bench/bench_clustering.py [--batches 4] [--threads 1]
        The report of bench/results/clustering.md: for Zipf 1.05, 1.2 and uniform and for 2, 4
        and 8 micro-batches, the unique keys summed over micro-batches under a random split,
        under `cluster_samples`, and grouped by the true user id (an oracle: the ids are not in
        the keys), against the whole batch's unique keys (the floor of any split); then
        median times of cluster_samples, data generation and a TorchRec EmbeddingBagCollection
        lookup (forward; forward + backward) on the same batch, measured in interleaved rounds
        so that load from other processes hits all of them alike.

    .venv/bin/python -m pytest bench/bench_clustering.py --benchmark-only \
        --benchmark-columns=min,median,mean,rounds
        pytest-benchmark timings of the same providers on one thread (cluster: recxla and the
        Python reference on a small batch; generate; ebc-forward), with the unique-key figures
        in extra_info.

Batch: 8192 samples of the default profile (`criteo_kaggle_profile`: 26 Criteo Kaggle tables,
requests of 4-28 candidates, user history of 10-100 ids). Keys are counted once per micro-batch
and feature (key_bytes = 1); with one embedding size for every table, bytes scale the same way.
The lookup uses tables capped at 100,000 rows (the ids of the capped profile), dimension 64.
"""

import argparse
import itertools
import os
import platform
import statistics
import sys
import time

# Large tensors on 2 MB pages, as bench/conftest.py sets for the pytest runs (fresh 4 KiB pages
# cost about 3 us each on these VMs, more than the work being timed).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import recxla  # noqa: E402
from recxla.ops.cluster import micro_batch_unique_keys, random_split  # noqa: E402
from recxla.data import SyntheticRankingDataset, criteo_kaggle_profile  # noqa: E402
from recxla.data import embedding_bag_configs  # noqa: E402
from recxla.reference.cluster import cluster_samples_ref  # noqa: E402

BATCH = 8192
MICRO_BATCHES = (2, 4, 8)
EXPONENTS = (1.05, 1.2, 0.0)
LOOKUP_ROWS = 100_000
LOOKUP_DIM = 64


def unique_keys_row(batch, num_micro_batches: int, generator: torch.Generator) -> dict:
    """Summed unique keys of one batch under each way of splitting it into micro-batches."""
    kjt = batch.sparse
    b = kjt.stride()
    offsets = torch.arange(num_micro_batches + 1) * b // num_micro_batches
    users = kjt["cat_2"].values()
    oracle = torch.sort(users, stable=True).indices
    splits = {
        "floor": (torch.arange(b), torch.tensor([0, b])),
        "random": random_split(b, num_micro_batches, generator),
        "clustered": recxla.cluster_samples(kjt, num_micro_batches),
        "by_user": (oracle, offsets),
    }
    return {name: micro_batch_unique_keys(kjt, *s).sum().item() for name, s in splits.items()}


def unique_keys_table(num_batches: int, lines: list) -> None:
    lines += [
        "| profile | Zipf | M | floor | random split | cluster_samples | by user id (oracle) "
        "| fewer than random: mean (min-max over batches) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    default = ("default", {}, 1)
    cases = [(default, z, MICRO_BATCHES) for z in EXPONENTS] + [
        (("requests spread over 2 batches", {}, 2), 1.05, (4,)),
        (("history 20-100 ids", {"history_pooling": (20, 100)}, 1), 1.05, (4,)),
        (("no user interests", {"interest_share": 0.0}, 1), 1.05, (4,)),
    ]
    for (label, kwargs, spread), zipf, micro_batches in cases:
        profile = criteo_kaggle_profile(zipf=zipf, **kwargs)
        ds = SyntheticRankingDataset(profile, batch_size=BATCH, seed=0, request_spread=spread)
        batches = [ds.batch(i) for i in range(num_batches)]
        g = torch.Generator().manual_seed(0)
        for m in micro_batches:
            rows = [unique_keys_row(b, m, g) for b in batches]
            mean = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
            savings = [1 - r["clustered"] / r["random"] for r in rows]
            name = "uniform" if zipf == 0 else f"{zipf}"
            lines.append(
                f"| {label} | {name} | {m} | {mean['floor']:,.0f} | {mean['random']:,.0f} "
                f"| {mean['clustered']:,.0f} | {mean['by_user']:,.0f} "
                f"| {100 * statistics.mean(savings):.1f}% "
                f"({100 * min(savings):.1f}-{100 * max(savings):.1f}%) |"
            )
            print(lines[-1], flush=True)


def timing_table(rounds: int, lines: list) -> None:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    profile = criteo_kaggle_profile(max_rows=LOOKUP_ROWS)
    ds = SyntheticRankingDataset(profile, batch_size=BATCH, seed=0)
    kjt = ds.batch(0).sparse
    ebc = EmbeddingBagCollection(
        tables=embedding_bag_configs(profile, LOOKUP_DIM), device=torch.device("cpu")
    )

    def forward_backward():
        ebc(kjt).values().sum().backward()

    fresh = itertools.count(1)  # a batch not generated before, every call

    providers = {
        "cluster_samples (M=4)": lambda: recxla.cluster_samples(kjt, 4),
        "cluster_samples (M=8)": lambda: recxla.cluster_samples(kjt, 8),
        "generate one batch": lambda: ds.batch(next(fresh)),
        "EBC lookup, forward": lambda: ebc(kjt),
        "EBC lookup, forward + backward": forward_backward,
    }
    times = {name: [] for name in providers}
    for fn in providers.values():
        fn()  # warm-up
    for _ in range(rounds):  # interleaved, so load from other processes hits every provider
        for name, fn in providers.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    fwd = statistics.median(times["EBC lookup, forward"])
    lines += [
        f"| what (batch {BATCH}, {torch.get_num_threads()} thread(s)) | median ms | min ms "
        "| vs EBC forward |",
        "|---|---|---|---|",
    ]
    for name, t in times.items():
        med = statistics.median(t)
        lines.append(f"| {name} | {1e3 * med:.1f} | {1e3 * min(t):.1f} | {med / fwd:.2f}x |")
        print(lines[-1], flush=True)
    gen = statistics.median(times["generate one batch"])
    lines.append("")
    lines.append(f"Generation: {1 / gen:.0f} batches/s = {BATCH / gen / 1e3:.0f}k samples/s.")
    lines.append(f"Lookup: {kjt.values().numel():,} ids per batch.")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=4, help="batches per unique-key figure")
    parser.add_argument("--rounds", type=int, default=15, help="timing rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = [
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load average {os.getloadavg()[0]:.1f}",
        "",
    ]
    unique_keys_table(args.batches, lines)
    lines.append("")
    timing_table(args.rounds, lines)
    print("\n".join(lines))


# ---- pytest-benchmark -------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as in the report: on a 2-core machine shared with other jobs, two
    OpenMP threads wait on each other and time the load more than the work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def default_batch():
    return SyntheticRankingDataset(batch_size=BATCH, seed=0).batch(0)


@pytest.mark.parametrize("num_micro_batches", MICRO_BATCHES)
def test_cluster_samples(benchmark, default_batch, num_micro_batches):
    kjt = default_batch.sparse
    perm, offsets = benchmark(recxla.cluster_samples, kjt, num_micro_batches)
    benchmark.extra_info.update(
        unique_keys_row(default_batch, num_micro_batches, torch.Generator().manual_seed(0))
    )
    benchmark.extra_info["n_keys"] = kjt.values().numel()


def test_cluster_samples_reference_small(benchmark):
    """The Python reference on batch 512 (it is the oracle of the tests, not a fast path)."""
    kjt = SyntheticRankingDataset(batch_size=512, seed=0).batch(0).sparse
    benchmark.pedantic(cluster_samples_ref, args=(kjt, 4), rounds=3, iterations=1)


def test_generate_batch(benchmark):
    ds = SyntheticRankingDataset(batch_size=BATCH, seed=0)
    counter = iter(range(10**9))
    benchmark(lambda: ds.batch(next(counter)))


def test_ebc_forward(benchmark):
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    profile = criteo_kaggle_profile(max_rows=LOOKUP_ROWS)
    kjt = SyntheticRankingDataset(profile, batch_size=BATCH, seed=0).batch(0).sparse
    ebc = EmbeddingBagCollection(
        tables=embedding_bag_configs(profile, LOOKUP_DIM), device=torch.device("cpu")
    )
    benchmark(ebc, kjt)


@pytest.mark.gpu
@pytest.mark.parametrize("num_micro_batches", MICRO_BATCHES)
def test_cluster_samples_cuda(benchmark, default_batch, num_micro_batches):
    kjt = default_batch.sparse.to(torch.device("cuda"))

    def run():
        out = recxla.cluster_samples(kjt, num_micro_batches)
        torch.cuda.synchronize()
        return out

    run()  # the first call loads the kernels: not timed
    benchmark(run)


if __name__ == "__main__":
    main()
