"""The synthetic ranking-log dataset: shapes, determinism, skew, request structure, labels."""

import pytest
import torch

from recxla.data import (
    CRITEO_KAGGLE_NUM_EMBEDDINGS,
    Profile,
    SparseFeature,
    SyntheticRankingDataset,
    criteo_kaggle_profile,
    embedding_bag_configs,
)
from recxla.data import hashing

MASK64 = (1 << 64) - 1


def splitmix64_int(x: int) -> int:
    """SplitMix64's finalizer on Python ints, written from the published constants."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


@pytest.fixture
def seed_value(seed):
    return seed % 1000


def small_dataset(seed, batch_size=512, **kwargs):
    profile = criteo_kaggle_profile(**kwargs)
    return SyntheticRankingDataset(profile, batch_size=batch_size, seed=seed)


def test_splitmix64_matches_python_ints():
    x = torch.randint(-(2**63), 2**63 - 1, (1000,), dtype=torch.int64)
    got = hashing.splitmix64(x).tolist()
    want = [splitmix64_int(v & MASK64) for v in x.tolist()]
    assert [g & MASK64 for g in got] == want


def test_scramble_is_a_bijection_of_the_table():
    size = int(torch.randint(2, 5000, ()).item())
    rows = hashing.scramble(torch.arange(size), size, int(torch.randint(0, 2**62, ()).item()))
    assert torch.equal(rows.sort().values, torch.arange(size))


@pytest.mark.parametrize("exponent", [0.0, 1.0, 1.05, 1.2])
def test_zipf_ranks_follow_the_law(exponent):
    n = 1000
    ranks = hashing.zipf_ranks(torch.rand(400_000, dtype=torch.float64), n, exponent)
    assert int(ranks.min()) >= 0 and int(ranks.max()) < n
    freq = torch.bincount(ranks, minlength=n).double()
    # Slope of log frequency against log rank over ranks 2..50 (the head is approximate).
    k = torch.arange(2, 51, dtype=torch.float64)
    x, y = torch.log(k + 1), torch.log(freq[2:51])
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    assert abs(-slope.item() - exponent) < 0.08, slope


def test_batch_shapes_and_dtypes(seed_value):
    ds = small_dataset(seed_value, batch_size=333)
    b = ds.batch(0)
    profile = ds.profile
    kjt = b.sparse
    assert kjt.keys() == [f"cat_{i}" for i in range(26)]
    assert kjt.stride() == 333
    assert kjt.values().dtype == torch.int64 and kjt.lengths().dtype == torch.int32
    assert b.dense.shape == (333, 13) and b.dense.dtype == torch.float32
    assert b.labels.shape == (333,) and b.labels.dtype == torch.float32
    assert bool(((b.labels == 0) | (b.labels == 1)).all())
    assert bool(torch.isfinite(b.dense).all()) and bool((b.dense > 0).all())
    for f, (name, jt) in zip(profile.features, kjt.to_dict().items()):
        assert f.name == name
        lo, hi = f.pooling
        assert int(jt.lengths().min()) >= lo and int(jt.lengths().max()) <= hi
        if jt.values().numel():
            assert 0 <= int(jt.values().min()) and int(jt.values().max()) < f.num_embeddings
    assert profile.num_embeddings == list(CRITEO_KAGGLE_NUM_EMBEDDINGS)
    moved = b.to("cpu")
    assert torch.equal(moved.labels, b.labels) and moved.batch_size == 333


def test_same_seed_same_batches_other_seed_differs(seed_value):
    a, b = small_dataset(seed_value), small_dataset(seed_value)
    other = small_dataset(seed_value + 1)
    for i in (0, 3):
        x, y = a.batch(i), b.batch(i)
        assert torch.equal(x.sparse.values(), y.sparse.values())
        assert torch.equal(x.sparse.lengths(), y.sparse.lengths())
        assert torch.equal(x.dense, y.dense) and torch.equal(x.labels, y.labels)
    assert not torch.equal(a.batch(0).sparse.values()[:512], other.batch(0).sparse.values()[:512])
    assert not torch.equal(a.batch(0).dense, a.batch(1).dense)


def test_iteration_and_ranks_follow_batch_index(seed_value):
    ds = SyntheticRankingDataset(batch_size=64, num_batches=3, seed=seed_value)
    assert len(ds) == 3
    got = [b.labels for b in ds]
    assert len(got) == 3 and all(torch.equal(g, ds.batch(i).labels) for i, g in enumerate(got))
    rank1 = SyntheticRankingDataset(batch_size=64, seed=seed_value, rank=1, world_size=2)
    assert torch.equal(rank1.batch(1).dense, ds.batch(3).dense)


def test_user_features_repeat_within_requests(seed_value):
    ds = small_dataset(seed_value, batch_size=2048)
    b = ds.batch(0)
    bags = {name: [t.tolist() for t in jt.to_dense()] for name, jt in b.sparse.to_dict().items()}
    requests = b.request_ids
    multi = requests.unique(return_counts=True)
    many = multi[0][multi[1] >= 4][:30]
    assert many.numel() >= 10
    user = ds.profile.side_of("user")
    varied = 0
    for r in many.tolist():
        rows = (requests == r).nonzero().flatten().tolist()
        for name in user:
            assert len({tuple(bags[name][i]) for i in rows}) == 1, name
        varied += len({tuple(bags["cat_20"][i]) for i in rows}) > 1
    assert varied >= 0.8 * many.numel()


def test_candidates_of_a_request_share_interest_categories(seed_value):
    """Half the candidates come from the user's interest categories, so two candidates of one
    request share a category-level key (cat_0) more often than two of different requests."""

    def share_rates(interest_share):
        profile = criteo_kaggle_profile(interest_share=interest_share)
        b = SyntheticRankingDataset(profile, batch_size=3000, seed=seed_value).batch(0)
        cat = b.sparse["cat_0"].values()
        _, req = b.request_ids.unique(return_inverse=True)
        same_req = req[:, None] == req[None, :]
        same_req.fill_diagonal_(False)
        same_cat = cat[:, None] == cat[None, :]
        other_req = req[:, None] != req[None, :]
        within = (same_cat & same_req).sum() / same_req.sum()
        across = (same_cat & other_req).sum() / other_req.sum()
        return within.item(), across.item()

    within, across = share_rates(0.5)
    assert within > across + 0.03, (within, across)
    within, across = share_rates(0.0)
    assert within < across + 0.02, (within, across)


def test_request_spread_keeps_requests_in_nearby_batches(seed_value):
    spread1 = small_dataset(seed_value, batch_size=256)
    a, b = spread1.batch(0).request_ids, spread1.batch(1).request_ids
    assert not set(a.tolist()) & set(b.tolist())
    ds = SyntheticRankingDataset(batch_size=256, seed=seed_value, request_spread=2)
    x, y, z = (ds.batch(i).request_ids for i in range(3))
    assert set(x.tolist()) & set(y.tolist())  # one block of two batches
    assert not set(y.tolist()) & set(z.tolist())


def test_zipf_skew_present_and_uniform_option(seed_value):
    def top_share(zipf):
        ds = small_dataset(seed_value, batch_size=8192, zipf=zipf)
        items = ds.batch(0).sparse["cat_20"].values()
        counts = items.unique(return_counts=True)[1].sort(descending=True).values
        return counts[: max(1, counts.numel() // 100)].sum().item() / items.numel()

    skewed, uniform = top_share(1.05), top_share(0.0)
    assert skewed > 0.1, skewed  # the top 1% of item ids hold 10x their share of samples
    assert uniform < 0.03, uniform


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Rank-based AUC (Mann-Whitney U)."""
    ranks = torch.empty_like(scores)
    ranks[scores.argsort()] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return (ranks[pos].sum().item() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def test_labels_are_learnable(seed_value):
    ds = small_dataset(seed_value, batch_size=3000)
    train, test = ds.batch(0), ds.batch(1)
    assert 0.1 < train.labels.mean().item() < 0.5

    def features(b):
        # Dense features and one-hots of three small user-side tables.
        cols = [b.dense.double()]
        for name, rows in (("cat_5", 24), ("cat_13", 27), ("cat_21", 18)):
            cols.append(torch.nn.functional.one_hot(b.sparse[name].values(), rows).double())
        return torch.cat(cols, 1)

    x, y = features(train), train.labels.double()
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    x = (x - mean) / std
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, bias], max_iter=100)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + bias, y)
        loss = loss + 1e-3 * (w**2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        score = ((features(test) - mean) / std) @ w + bias
    assert auc(score, test.labels) > 0.6  # chance is 0.5 +- 0.013 here


def test_embedding_bag_configs_and_capped_tables(seed_value):
    configs = embedding_bag_configs(embedding_dim=16)
    assert [c.num_embeddings for c in configs] == list(CRITEO_KAGGLE_NUM_EMBEDDINGS)
    for i, c in enumerate(configs):
        assert c.embedding_dim == 16 and c.feature_names == [f"cat_{i}"]
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    profile = criteo_kaggle_profile(max_rows=1000)
    tables = embedding_bag_configs(profile, embedding_dim=4)
    assert max(c.num_embeddings for c in tables) == 1000
    ds = SyntheticRankingDataset(profile, batch_size=97, seed=seed_value)
    assert ds.embedding_bag_configs(4)[2].num_embeddings == 1000
    pooled = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))(ds.batch(0).sparse)
    assert pooled.values().shape == (97, 26 * 4)


@pytest.mark.gpu
def test_pinned_batch_moves_to_cuda(seed_value):
    b = small_dataset(seed_value, batch_size=64).batch(0)
    on_gpu = b.pin_memory().to("cuda", non_blocking=True)
    assert on_gpu.sparse.values().is_cuda and on_gpu.dense.is_cuda
    assert torch.equal(on_gpu.labels.cpu(), b.labels)


def test_custom_profile_without_item_features(seed_value):
    profile = Profile(
        "users_only",
        (SparseFeature("u", 50, "user", "id"), SparseFeature("h", 30, "user", "history", (0, 3))),
        num_users=50, num_items=40, num_categories=4, num_dense=2,
    )  # fmt: skip
    b = SyntheticRankingDataset(profile, batch_size=17, seed=seed_value).batch(0)
    assert b.sparse.keys() == ["u", "h"] and b.dense.shape == (17, 2)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        SyntheticRankingDataset(batch_size=0)
    with pytest.raises(ValueError, match="rank must be < world_size"):
        SyntheticRankingDataset(rank=2, world_size=2)
    with pytest.raises(ValueError, match="request_spread"):
        SyntheticRankingDataset(request_spread=0)
    with pytest.raises(ValueError, match="max_rows must be an int >= 1"):
        criteo_kaggle_profile(max_rows=0)
    with pytest.raises(ValueError, match="zipf must be >= 0"):
        criteo_kaggle_profile(zipf=-1.0)
    with pytest.raises(ValueError, match="request_size"):
        criteo_kaggle_profile(request_size=(0, 4))
    with pytest.raises(ValueError, match="history feature must be user-side"):
        SparseFeature("h", 10, "item", "history")
    with pytest.raises(ValueError, match="embedding_dim must be an int >= 1"):
        embedding_bag_configs(embedding_dim=0)
    with pytest.raises(TypeError, match="profile must be a Profile"):
        SyntheticRankingDataset(profile="criteo")
