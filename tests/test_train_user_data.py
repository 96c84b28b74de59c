"""recxla-train on a user's own click log, converted by recxla.data.convert: the model follows
the dataset (its tables, shared tables, pooling, dims and dense width, with overrides from the
command line), the held-out rows are split off by timestamp, both paths train it on 2 ranks from
`--data DIR` alone and `--compare` shows their held-out AUC and log loss, and sharded training
equals the unsharded model with fp32 comms on both paths."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from distributed_utils import run_distributed
from test_train_cli import RANK_PYTHONPATH, REPO, _parse_error, launch_ranks

import sharded_cases as cases
from recxla.data import ParquetDataset
from recxla.train.parse import parse_config
from recxla.train.data import TrainData

ROWS = 20 * 1024  # 20 row groups: the default batch of 1024 fills a 10% held-out split on 2 ranks
ROWS_PER_GROUP = 1024
DENSE = ["age", "price", "score"]
SCHEMA = """
label = "clicked"
timestamp = "ts"
dense = ["age", "price", "score"]
[sparse.user]
column = "user_id"
[sparse.item]
column = "item_id"
table = "items"
[sparse.history]
column = "recent_items"
table = "items"
[sparse.genres]
column = "genres"
pooling = "mean"
[tables.items]
dim = 8
"""


def _click_log(path, seed: int) -> None:
    """A click log as a user writes it with pyarrow: string user ids, int64 item ids above
    2^40, a list<string> and a list<int64> sequence column, floats, a 0/1 label that depends
    on the user, the item and a float, and a timestamp. The rows are in time order except that
    the two halves of the file are swapped (the latest rows sit in the middle)."""
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 300, ROWS)
    items = rng.integers(0, 500, ROWS)
    user_bias, item_bias = rng.normal(0, 1.5, 300), rng.normal(0, 1.5, 500)
    age = rng.uniform(18, 70, ROWS).astype(np.float32)
    logit = user_bias[users] + item_bias[items] + (age - 44) / 20 - 1.0
    clicked = (rng.random(ROWS) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    genre_names = np.array(["drama", "comedy", "noir", "sci-fi", "horror", "romance"])
    genres = [list(genre_names[rng.choice(6, rng.integers(1, 4), replace=False)])
              for _ in range(ROWS)]
    history = [list((1 << 40) + 7919 * rng.integers(0, 500, rng.integers(0, 6)))
               for _ in range(ROWS)]
    ts = np.arange(ROWS, dtype=np.int64) * 60 + 1_700_000_000
    order = np.concatenate([np.arange(ROWS // 2, ROWS), np.arange(ROWS // 2)])
    table = pa.table({
        "user_id": pa.array([f"u{u:05d}" for u in users]),
        "item_id": pa.array((1 << 40) + 7919 * items, pa.int64()),
        "recent_items": pa.array(history, pa.list_(pa.int64())),
        "genres": pa.array(genres, pa.list_(pa.string())),
        "age": age, "price": rng.lognormal(3, 1, ROWS).astype(np.float32),
        "score": rng.normal(0, 1, ROWS).astype(np.float32),
        "clicked": clicked, "ts": ts,
    }).take(pa.array(order))
    pq.write_table(table, path)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from recxla.data.convert import convert

    root = tmp_path_factory.mktemp("user_data")
    _click_log(root / "clicks.parquet", seed=7)
    (root / "schema.toml").write_text(SCHEMA)
    out = str(root / "converted")
    convert(str(root / "clicks.parquet"), out, str(root / "schema.toml"),
            rows_per_group=ROWS_PER_GROUP, progress=False)
    return out


def _timestamps(path, groups):
    info = ParquetDataset(path, 1).info
    out = []
    for i in groups:
        fi, gi, _ = info.row_groups[i]
        out.append(pq.ParquetFile(info.files[fi].path).read_row_group(gi, ["timestamp"])
                   .column(0).to_numpy())
    return np.concatenate(out)


def test_model_follows_the_dataset(dataset):
    config = parse_config(["--data", dataset])
    assert config.model_from_data and config.eval_fraction == 0.1
    assert config.embedding_dim == 8  # the dim the schema names
    data = TrainData(config, 0, 2)
    tables = {t.name: t for t in data.tables()}
    # "items" is an attribute of torch's ModuleDict: the model's table is "items_table".
    assert set(tables) == {"items_table", "t_user", "t_genres"}
    assert tables["items_table"].feature_names == ["item", "history"]  # one table, 2 features
    assert tables["t_genres"].pooling.name == "MEAN"
    assert tables["items_table"].pooling.name == "SUM"
    assert tables["t_user"].num_embeddings >= 300 and tables["t_genres"].num_embeddings >= 6
    assert all(t.embedding_dim == 8 for t in tables.values()) and data.num_dense == len(DENSE)
    batch = data.sample()
    assert batch.dense_features.shape == (1024, len(DENSE))
    assert set(batch.sparse_features.keys()) == {"user", "item", "history", "genres"}
    # The held-out row groups are the latest by timestamp (the middle of the file here), a
    # tenth of the rows, none of them trained on.
    assert len(data.eval_groups) == 2 and len(data.train_groups) == 18
    assert not set(data.eval_groups) & set(data.train_groups)
    assert _timestamps(dataset, data.eval_groups).min() > \
        _timestamps(dataset, data.train_groups).max()
    assert data.eval_groups != [18, 19]  # not merely the last in file order
    held_out = list(data.held_out())
    assert len(held_out) == 1 and held_out[0].labels.numel() == 1024  # one group a rank
    # The command line overrides dims and rows; a profile's model ignores the dataset's.
    dim = parse_config(["--data", dataset, "--embedding-dim", "4", "--table-rows",
                        "t_user=5000"])
    wide = {t.name: t for t in TrainData(dim, 0, 2).tables()}
    assert wide["t_user"].num_embeddings == 5000 and wide["items_table"].embedding_dim == 4
    assert parse_config(["--data", dataset, "--eval-fraction", "0.3"]).eval_fraction == 0.3


def test_bad_dataset_options(capsys, monkeypatch, dataset):
    err = _parse_error(capsys, ["--data", dataset, "--table-rows", "nope=10"])
    assert "--table-rows: unknown table(s) ['nope']" in err
    err = _parse_error(capsys, ["--data", dataset, "--table-rows", "t_user=2"])
    assert "--data: recxla.data: " in err and "t_user has 2 rows" in err
    monkeypatch.setenv("WORLD_SIZE", "2")  # 19 of 20 row groups held out leave 1 for 2 ranks
    err = _parse_error(capsys, ["--data", dataset, "--eval-fraction", "0.95"])
    assert "--eval-fraction: " in err and "lower --eval-fraction" in err
    err = _parse_error(capsys, ["--data", dataset, "--eval-data", dataset, "--eval-fraction",
                                "0.2"])
    assert "give one or the other" in err


@pytest.fixture(scope="module")
def one_group_dataset(dataset):
    """The click log converted into one row group (as `convert`'s default row groups did with
    a log this small): nothing to split into training and held-out row groups."""
    from recxla.data.convert import convert

    root = os.path.dirname(dataset)
    out = os.path.join(root, "one_group")
    convert(os.path.join(root, "clicks.parquet"), out, os.path.join(root, "schema.toml"),
            rows_per_group=ROWS, progress=False)
    return out


def test_too_few_row_groups_to_split_name_the_conversion_that_helps(
        capsys, monkeypatch, one_group_dataset):
    """Row groups are what the ranks share out: a dataset of one cannot be split at any
    --eval-fraction, and the error says what helps: converting with smaller row groups."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    err = _parse_error(capsys, ["--data", one_group_dataset])
    assert "--eval-fraction: " in err and "1 row groups" in err
    # 10% of the 20,480 rows on 2 ranks: row groups of 1,024 rows give each rank one.
    assert "`python -m recxla.data convert SRC --out DIR --rows-per-group 1024`" in err
    assert "lower --eval-fraction" not in err and "--eval-data" in err


def test_held_out_split_is_evaluated_whole(dataset):
    """Without --eval-batches every rank evaluates its whole share of the held-out row groups
    (not the first 8 batches); --eval-batches caps it."""
    for batch, cap, want in ((64, None, 16), (64, 3, 3), (1024, None, 1)):
        argv = ["--data", dataset, "--batch-size", str(batch)]
        config = parse_config(argv + (["--eval-batches", str(cap)] if cap else []))
        # 2 held-out row groups of 1,024 rows: one a rank, 1,024 / batch batches each.
        got = [len(list(TrainData(config, r, 2).held_out())) for r in range(2)]
        assert got == [want, want], (batch, cap, got)


@pytest.mark.distributed
def test_a_data_error_under_torchrun_is_printed_once_with_status_2(one_group_dataset, tmp_path):
    """torchrun with a data error every rank finds: the message once, on one line (no usage
    text), every rank's exit status 2. torchrun's own status is 1 whatever its workers' (its
    ChildFailedError), so its failure summary is where the 2 shows: the root cause's; a rank
    still checking when the first exits is ended by torchrun's SIGTERM (-15)."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "recxla.train", "--data", one_group_dataset, "--steps", "4"],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=RANK_PYTHONPATH), capture_output=True,
        text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert out.count("recxla-train: error: --eval-fraction: ") == 1, out[-3000:]
    assert "--rows-per-group" in out and "usage:" not in out
    summary = re.compile(r"^\s+exitcode\s+: (-?\d+)", re.M)  # torchrun's failure summary
    codes = summary.findall(out)
    assert len(codes) == 2 and set(codes) <= {"2", "-15"}, out[-3000:]
    assert summary.search(out[out.index("Root Cause"):]).group(1) == "2", out[-3000:]


@pytest.mark.distributed
def test_both_paths_train_the_dataset_from_data_alone(dataset, tmp_path):
    rx, tr = str(tmp_path / "recxla.json"), str(tmp_path / "torchrec.json")
    for name, path, extra in (("recxla", rx, []), ("torchrec", tr, ["--baseline", "torchrec"])):
        (tmp_path / name).mkdir()
        launch_ranks(["--data", dataset, "--steps", "6", "--metrics", path, *extra],
                     tmp_path / name, timeout=400)
    for path, name in ((rx, "recxla"), (tr, "torchrec")):
        with open(path) as f:
            m = json.load(f)
        assert m["path"] == name and m["tables"] == 3
        assert m["config"]["embedding_dim"] == 8 and m["config"]["data"] == dataset
        assert m["eval_examples"] == 2 * 1024 and "--eval-fraction 0.1" in m["eval_data"]
        assert 0.0 <= m["auc"] <= 1.0 and 0.2 < m["eval_loss"] < 2.0
        assert set(m["plan"]) == {"items_table", "t_user", "t_genres"}
    out = subprocess.run([sys.executable, "-m", "recxla.train", "--compare", tr, rx, "--chart",
                          ""], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "log loss (held-out)" in out.stdout and "AUC" in out.stdout


LR = 0.05


def _sharded_equals_unsharded(rank, world, dataset, steps):
    """Both paths, fp32 comms, SGD: the trainer's own model, plan, sharder and tables on the
    dataset, against the unsharded model trained on every rank's batches."""
    import copy

    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recxla.pipeline import TrainPipeline
    from recxla.train.models import build_model, init_embedding_tables, table_init
    from recxla.train.sharding import (
        build_optimizer, build_sharders, embedding_tables, plan_sharding, shard_model)

    errors = {}
    for path in ([], ["--baseline", "torchrec"]):
        config = parse_config([
            "--data", dataset, "--batch-size", "64", "--dense-arch", "16", "--over-arch", "16",
            "--sparse-optimizer", "sgd", "--dense-optimizer", "sgd", "--sparse-lr", str(LR),
            "--dense-lr", str(LR), "--sharding", "table_wise", "--loader-workers", "0",
            "--device", "cpu", *(path or ["--fwd-comm", "fp32", "--bwd-comm", "fp32",
                                          "--row-exchange", "off"])])
        shards = [TrainData(config, r, world) for r in range(world)]
        tables = shards[rank].tables()
        device = torch.device("cpu")
        model = build_model(config, tables, shards[rank].num_dense, device)
        reference = copy.deepcopy(model)
        ebc = reference.model.sparse_arch.embedding_bag_collection
        ebc.to_empty(device=device)
        with torch.no_grad():
            for i, t in enumerate(tables):
                ebc.embedding_bags[t.name].weight.copy_(table_init(t, i, config.seed))
        plan = plan_sharding(model, config, tables, world, world, device)
        dmp = shard_model(model, build_sharders(config), plan, device, config)
        init_embedding_tables(embedding_tables(dmp), tables, config.seed)
        optimizer = build_optimizer(dmp, config)
        pipeline = (TrainPipelineSparseDist(dmp, optimizer, device) if config.baseline
                    else TrainPipeline(dmp, optimizer, device))
        per_rank = [list(d.train(0, steps)) for d in shards]
        for d in shards:
            d.close()
        local = iter(per_rank[rank])
        for _ in range(steps):
            pipeline.progress(local)
        sgd = torch.optim.SGD(reference.parameters(), lr=LR)
        for step in range(steps):
            loss = sum(reference(per_rank[r][step])[0] for r in range(world))
            loss.backward()
            for name, p in reference.named_parameters():
                if "embedding_bags" not in name:
                    p.grad /= world  # DDP averages the dense gradients
            sgd.step()
            sgd.zero_grad()
        want = {k: v.detach() for k, v in reference.state_dict().items()}
        state = dmp.state_dict()
        dense = max(cases.relative(v, want[k]) for k, v in state.items()
                    if not hasattr(v, "local_shards"))
        errors[config.path] = (cases.shard_errors(state, want), dense)
    return errors


CSV_SCHEMA = """
label = "clicked"
timestamp = "ts"
dense = ["age", "score"]
[sparse.user]
column = "user_id"
[sparse.item]
column = "item_id"
[sparse.genres]
column = "genres"
separator = "|"
pooling = "mean"
"""


def _csv_dataset(root) -> str:
    """The click log as a CSV file: string user ids, int64 item ids above 2^40, genres as a
    '|'-separated bag, floats, a 0/1 label and an integer timestamp."""
    from recxla.data.convert import convert

    rng = np.random.default_rng(11)
    n = 4096
    users, items = rng.integers(0, 200, n), rng.integers(0, 300, n)
    genres = ["|".join(rng.choice(["drama", "noir", "comedy", "horror"], rng.integers(0, 3)))
              for _ in range(n)]
    lines = ["user_id,item_id,genres,age,score,clicked,ts"]
    lines += [f"u{users[i]},{(1 << 40) + 7919 * int(items[i])},{genres[i]},"
              f"{rng.uniform(18, 70):.3f},{rng.normal():.4f},{int(rng.random() < 0.3)},"
              f"{1_700_000_000 + 60 * i}" for i in range(n)]
    (root / "clicks.csv").write_text("\n".join(lines) + "\n")
    (root / "csv.toml").write_text(CSV_SCHEMA)
    out = str(root / "csv_converted")
    convert(str(root / "clicks.csv"), out, str(root / "csv.toml"), rows_per_group=512,
            progress=False)
    return out


def _criteo_dataset(root) -> str:
    """Criteo TSV lines with missing fields; 1,000 rows per table keep the 26 tables small."""
    import random

    from data_convert_cases import criteo_lines

    from recxla.data.convert import convert

    (root / "day_0.tsv").write_text("\n".join(criteo_lines(4096, random.Random(5))) + "\n")
    (root / "criteo.toml").write_text("default_rows = 1000\n")
    out = str(root / "criteo_converted")
    convert(str(root / "day_0.tsv"), out, str(root / "criteo.toml"), "criteo-tsv",
            rows_per_group=512, progress=False)
    return out


@pytest.fixture(scope="module", params=["parquet", "csv", "criteo-tsv"])
def any_format_dataset(request, tmp_path_factory, dataset):
    if request.param == "parquet":
        return dataset
    root = tmp_path_factory.mktemp(request.param)
    return _csv_dataset(root) if request.param == "csv" else _criteo_dataset(root)


@pytest.mark.distributed
def test_sharded_equals_unsharded_on_the_dataset(any_format_dataset):
    """Each input format, converted, trains on 2 ranks with both paths as the unsharded model."""
    results = run_distributed(_sharded_equals_unsharded, world_size=2,
                              args=(any_format_dataset, 3), timeout=300)
    for rank, per_path in enumerate(results):
        assert set(per_path) == {"recxla", "torchrec"}
        for path, (embedding_error, dense_error) in per_path.items():
            assert embedding_error <= 1e-5, (rank, path, embedding_error)
            assert dense_error <= 1e-5, (rank, path, dense_error)


def test_resume_with_another_split_or_table_rows_is_refused(dataset):
    """The held-out fraction decides which row groups train, and --table-rows the tables'
    shapes: a checkpoint resumed with other values would train other rows or fail to load."""
    from recxla.data.schema import read_dataset_spec
    from recxla.train import checkpoint

    config = parse_config(["--data", dataset, "--steps", "8"])
    state = {"world_size": 2, "path": "recxla", "steps_done": 4, "config": config.asdict(),
             "data_fingerprint": TrainData(config, 0, 2).fingerprint}
    checkpoint.check_compatible(config, 2, state)  # the same run: fine
    split = parse_config(["--data", dataset, "--steps", "8", "--eval-fraction", "0.3"])
    with pytest.raises(ValueError, match=r"--eval-fraction 0.1 \(now 0.3\)"):
        checkpoint.check_compatible(split, 2, state)
    table = read_dataset_spec(dataset).tables[1]  # t_user (the first, items, is renamed)
    rows = parse_config(["--data", dataset, "--steps", "8",
                         "--table-rows", f"{table.name}={2 * table.num_rows}"])
    with pytest.raises(ValueError, match=r"--table-rows"):
        checkpoint.check_compatible(rows, 2, state)
