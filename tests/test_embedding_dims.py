"""Bandwidth-aware embedding sizes: recxla.planner.embedding_dims (each table's wire bytes, the
proposal under a byte budget), the trainer's --embedding-dims and the model that pads the
smaller tables' pooled rows to the run's dim."""

import argparse
import json

import numpy as np
import pytest
import torch
from test_train_cli import SMALL, _parse_error, check_metrics, launch_ranks
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recxla.data import SyntheticRankingDataset, criteo_kaggle_profile, embedding_bag_configs
from recxla.formats import row_bytes
from recxla.planner.embedding_dims import TableWire, propose_dims, table_wire_bytes
from recxla.train import options
from recxla.train.models import PadFeatures, PaddedSparseArch, feature_runs, pad_features


def _batches(seed: int, world: int, batch: int = 256):
    profile = criteo_kaggle_profile(max_rows=5000)
    return profile, [SyntheticRankingDataset(profile, batch_size=batch, seed=seed, rank=r,
                                             world_size=world).batch(0) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_rows_are_every_other_ranks_samples_at_the_format(seed, world):
    """A table placed table-wise on one owner sends every other rank's samples one pooled row
    per feature forward and takes one gradient row back (the oracle counts them from the batch
    sizes); the ids' bytes do not depend on the dim."""
    profile, batches = _batches(seed % 1000, world)
    fwd, bwd = "e4m3", "bf16"
    for dim in (64, 16):
        tables = embedding_bag_configs(profile, dim)
        wire = table_wire_bytes(tables, batches, fwd, bwd)
        for i, (t, w) in enumerate(zip(tables, wire)):
            others = sum(b.batch_size for r, b in enumerate(batches) if r != i % world)
            want = others * len(t.feature_names) * (row_bytes(dim, fwd) + row_bytes(dim, bwd))
            assert (w.table, w.dim, w.rows) == (t.name, dim, want)
        if dim == 64:
            ids64 = [w.ids for w in wire]
        else:
            assert [w.ids for w in wire] == ids64
    assert sum(w.share for w in wire) == pytest.approx(1.0)


def test_one_rank_has_no_wire(seed):
    profile, batches = _batches(seed % 1000, 1)
    with pytest.raises(ValueError, match="2 ranks or more"):
        table_wire_bytes(embedding_bag_configs(profile, 64), batches)


def _rows(w: TableWire, dim: int) -> float:
    per = row_bytes(w.dim, "e4m3") + row_bytes(w.dim, "bf16")
    return w.rows * (row_bytes(dim, "e4m3") + row_bytes(dim, "bf16")) / per


@pytest.mark.parametrize("keep", [0.25, 0.5, 0.8, 1.0])
def test_proposal_meets_the_budget_by_halving_the_largest(seed, keep):
    rng = np.random.default_rng(seed)
    wire = [TableWire(f"t{i}", int(rng.choice([16, 32, 64, 128])), 1,
                      int(rng.integers(0, 10_000)), int(rng.integers(1_000, 1_000_000)))
            for i in range(int(rng.integers(2, 12)))]
    dims = propose_dims(wire, keep, fwd_comm="e4m3", bwd_comm="bf16")
    with pytest.warns(DeprecationWarning):  # the keywords docs/planner.md had
        assert propose_dims(wire, keep, fwd_fmt="e4m3", bwd_fmt="bf16") == dims
    before = sum(w.rows for w in wire)
    after = sum(_rows(w, dims[w.table]) for w in wire)
    for w in wire:
        d = dims[w.table]
        assert d <= w.dim and d % 4 == 0 and (d == w.dim or d >= 8)
        assert w.dim % d == 0 and (w.dim // d) & (w.dim // d - 1) == 0  # halvings only
    if after > keep * before + 1e-6:  # only when no table can be halved again
        assert all(dims[w.table] // 2 < 8 or (dims[w.table] // 2) % 4 for w in wire)
    if keep == 1.0:
        assert dims == {w.table: w.dim for w in wire}
    # Greedy: the table halved first is the one whose rows carried most bytes.
    if after < before:
        top = max(wire, key=lambda w: w.rows)
        assert dims[top.table] < top.dim or top.dim // 2 < 8


def test_proposal_arguments_are_checked():
    wire = [TableWire("t", 64, 1, 0, 100)]
    for keep in (0, -1, 1.5):
        with pytest.raises(ValueError, match="keep must be in"):
            propose_dims(wire, keep)
    with pytest.raises(ValueError, match="min_dim must be a multiple of 4"):
        propose_dims(wire, 0.5, min_dim=6)


def test_option_parses():
    assert options.embedding_dims("auto") == ("auto", 0.5)
    assert options.embedding_dims("auto:0.3") == ("auto", 0.3)
    assert options.embedding_dims("a=32,b=16") == (("a", 32), ("b", 16))
    for bad in ("auto:0", "auto:2", "auto:x", "a=30", "a", "a=0", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            options.embedding_dims(bad)


def test_padded_sparse_arch_pads_each_feature(seed):
    """Every feature's pooled rows, zero-padded to the run's dim, in DLRM's [B, F, D], and the
    gradient of the pooled values: both against a pad and a cat per feature."""
    torch.manual_seed(seed)
    tables = [EmbeddingBagConfig(name="t_a", embedding_dim=8, num_embeddings=50,
                                 feature_names=["a", "a2"]),  # one run of two features
              EmbeddingBagConfig(name="t_b", embedding_dim=16, num_embeddings=50,
                                 feature_names=["b"]),
              EmbeddingBagConfig(name="t_c", embedding_dim=4, num_embeddings=50,
                                 feature_names=["c"]),
              EmbeddingBagConfig(name="t_d", embedding_dim=4, num_embeddings=50,
                                 feature_names=["d"])]  # merged with c: another table
    dims = {f: t.embedding_dim for t in tables for f in t.feature_names}
    ebc = EmbeddingBagCollection(tables=tables)
    arch = PaddedSparseArch(ebc, 16)
    b = int(torch.randint(1, 9, ()))
    lengths = torch.randint(0, 4, (len(dims) * b,))
    kjt = KeyedJaggedTensor(keys=list(dims), values=torch.randint(0, 50, (int(lengths.sum()),)),
                            lengths=lengths)
    got = arch(kjt)
    pooled = ebc(kjt).to_dict()
    assert got.shape == (b, len(dims), 16)
    for i, (f, d) in enumerate(dims.items()):
        assert torch.equal(got[:, i, :d], pooled[f])
        assert torch.count_nonzero(got[:, i, d:]) == 0
    assert arch.sparse_feature_names == list(dims)

    values = torch.randn(b, sum(dims.values()), requires_grad=True)
    grad = torch.randn(b, len(dims), 16)
    runs = feature_runs(list(dims), list(dims.values()), {f: i for i, f in enumerate(dims)})
    PadFeatures.apply(values, runs, len(dims), 16).backward(grad)
    reference = values.detach().clone().requires_grad_()
    parts = torch.split(reference, list(dims.values()), dim=1)
    torch.stack([torch.nn.functional.pad(p, (0, 16 - p.shape[1])) for p in parts], dim=1) \
        .backward(grad)
    assert torch.equal(values.grad, reference.grad)


def test_feature_runs_follow_the_output_order():
    """Features the pooled values hold in another order than the output's: a run each."""
    runs = feature_runs(["b", "a", "c"], [4, 4, 4], {"a": 0, "b": 1, "c": 2})
    assert runs == [(1, 1, 4, 0), (0, 1, 4, 4), (2, 1, 4, 8)]
    assert feature_runs(["a", "b", "c"], [4, 4, 8], {"a": 0, "b": 1, "c": 2}) == \
        [(0, 2, 4, 0), (2, 1, 8, 8)]


def test_pad_features_takes_the_pooled_keys_in_any_order(seed):
    """A sharded collection's KeyedTensor holds the features in its own order (TorchRec's
    groups them by sharding type): each lands at its place in the output all the same."""
    torch.manual_seed(seed)
    values = torch.randn(3, 4 + 2 + 4)
    pooled = KeyedTensor(keys=["c", "a", "b"], length_per_key=[4, 2, 4], values=values)
    got = pad_features(pooled, ["a", "b", "c"], 6)
    assert torch.equal(got[:, 0, :2], values[:, 4:6])
    assert torch.equal(got[:, 1, :4], values[:, 6:])
    assert torch.equal(got[:, 2, :4], values[:, :4])
    assert torch.count_nonzero(got[:, 0, 2:]) + torch.count_nonzero(got[:, 1:, 4:]) == 0
    with pytest.raises(ValueError, match=r"PaddedSparseArch: the pooled KeyedTensor's keys "
                                         r"\['c', 'a', 'x'\] are not the collection's features"):
        pad_features(KeyedTensor(keys=["c", "a", "x"], length_per_key=[4, 2, 4], values=values),
                     ["a", "b", "c"], 6)


def test_unknown_tables_are_named(capsys):
    err = _parse_error(capsys, [*SMALL, "--embedding-dims", "t_cat_0=8,nope=16"])
    assert "--embedding-dims: unknown table(s) ['nope']" in err
    err = _parse_error(capsys, [*SMALL, "--embedding-dims", "t_cat_0=32"])  # SMALL: dim 16
    assert "--embedding-dims: {'t_cat_0': 32} above the run's dim 16" in err


@pytest.mark.distributed
@pytest.mark.parametrize("path", [[], ["--baseline", "torchrec"]], ids=["recxla", "torchrec"])
def test_trainer_takes_the_proposal(tmp_path, path):
    steps, warmup = 4, 1
    launch_ranks([*SMALL, *path, "--steps", str(steps), "--warmup-steps", str(warmup),
                  "--embedding-dims", "auto", "--metrics", str(tmp_path / "m.json")], tmp_path)
    m = check_metrics(tmp_path / "m.json", 2, steps, warmup)
    wire = m["table_wire"]
    dims = m["embedding_dims"]
    assert len(wire) == len(dims) == m["tables"] and min(dims.values()) < 16
    c = m["config"]
    fwd, bwd = (c["baseline_comms"],) * 2 if path else (c["fwd_comm"], c["bwd_comm"])
    assert dims == propose_dims([TableWire(**w) for w in wire], 0.5, fwd_comm=fwd, bwd_comm=bwd)
    json.dumps(m)  # the metrics stay JSON
