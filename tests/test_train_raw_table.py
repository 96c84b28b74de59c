"""recxla-train straight from a raw table (recxla.data.read_time): a click log bucketed by user,
joined at read time with a users feature table bucketed the same way (--join) and passed
through a transform file that derives an id column (--transform). On 2 gloo ranks: a run killed
after a checkpoint and resumed ends bit for bit where an uninterrupted run ends; the same log as
an Iceberg table pins its snapshot in the checkpoint, so a resume after rows were appended reads
the pinned snapshot (and one that no longer exists is an error naming it); the TorchRec baseline
trains the same table. Bad transforms, joins and options exit 2 before any process group,
naming what is wrong; starting the loader's worker processes leaves the generator a checkpoint
saves alone, and a resume with another --transform or --join names it."""

import json
import os
import re
import shutil
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_train_checkpoint import FP32 as SYNTHETIC_FP32
from test_train_checkpoint import _load, _write_checkpoint
from test_train_cli import SMALL, _parse_error, launch_ranks, start_ranks, wait_ranks
from test_train_crash_consistency import _killed_run

from recxla.data.buckets import bucket_of, write_buckets
from recxla.train import checkpoint, checkpoint_files
from recxla.train.data import TrainData, current_snapshots
from recxla.train.parse import parse_config

BUCKETS = 2
ROWS_PER_BUCKET = 2048
ROWS_PER_GROUP = 256  # 8 row groups a bucket: 16 in all, 2 held out (10%), 7 a rank to train
EPOCH_STEPS = 7 * ROWS_PER_GROUP // 128  # at --batch-size 128
USERS, ITEMS = 400, 600
# SMALL's model (tests/test_train_cli.py) and FP32's communication (test_train_checkpoint.py),
# without SMALL's --profile: with --data alone the model is the table's own.
MODEL = [*(a for a in SMALL if a not in ("--profile", "small")), "--warmup-steps", "1"]
FP32 = [a for a in SYNTHETIC_FP32 if a not in ("--profile", "small")]
HELD_OUT_EXAMPLES = 2 * ROWS_PER_GROUP  # the 2 latest row groups, one a rank, every row read
DERIVED = "price_level"

TRANSFORM = f'''
import pyarrow as pa
import pyarrow.compute as pc


def derive(batch):
    """An id column from a float: the price's octave."""
    t = pa.Table.from_batches([batch])
    level = pc.cast(pc.floor(pc.log2(pc.add(t["price"], 1.0))), pa.int64())
    return t.append_column("{DERIVED}", level)
'''


def _user_key(users: np.ndarray) -> np.ndarray:
    """Raw user ids as a log holds them: int64 far from the table rows they map to."""
    return users.astype(np.int64) * 7919 + (1 << 33)


def _click_log(rng, first_timestamp: int = 1_700_000_000) -> pa.Table:
    """2 * ROWS_PER_BUCKET rows in time order, exactly ROWS_PER_BUCKET in each bucket of
    user_id (so every row group holds ROWS_PER_GROUP rows and every rank's held-out row group
    fills whole batches): int64 ids, a string country, a float price, a 0/1 label that depends
    on the user, the item and the price, and an int64 timestamp."""
    users = rng.integers(0, USERS, 3 * ROWS_PER_BUCKET)
    buckets = bucket_of(_user_key(users), BUCKETS)
    keep = np.sort(np.concatenate([np.flatnonzero(buckets == b)[:ROWS_PER_BUCKET]
                                   for b in range(BUCKETS)]))
    assert len(keep) == BUCKETS * ROWS_PER_BUCKET
    users, n = users[keep], len(keep)
    items = rng.integers(0, ITEMS, n)
    price = rng.lognormal(2.0, 1.0, n)
    user_bias, item_bias = rng.normal(0, 1.5, USERS), rng.normal(0, 1.5, ITEMS)
    logit = user_bias[users] + item_bias[items] - 0.2 * np.log1p(price) - 0.5
    return pa.table({
        "user_id": pa.array(_user_key(users), pa.int64()),
        "item_id": pa.array(items, pa.int64()),
        "country": pa.array(rng.choice(["de", "fr", "us", "jp", "br"], n)),
        "price": pa.array(price, pa.float64()),
        "label": pa.array((rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)),
        "timestamp": pa.array(first_timestamp + 60 * np.arange(n), pa.int64()),
    })


def _users(rng) -> pa.Table:
    """One row per user (most of them: a user without a row joins as nulls): a float feature
    and a string segment."""
    ids = np.sort(rng.choice(USERS, USERS - 10, replace=False))
    return pa.table({
        "user_id": pa.array(_user_key(ids), pa.int64()),
        "affinity": pa.array(rng.normal(0, 1, len(ids)).astype(np.float32)),
        "segment": pa.array(rng.choice(["new", "casual", "loyal"], len(ids))),
    })


@pytest.fixture
def raw(tmp_path, seed):
    """The click log and the users table, each as a Parquet file and bucketed by user_id into
    BUCKETS folders of ROWS_PER_GROUP-row groups; the transform file."""
    rng = np.random.default_rng(seed)
    root = tmp_path / "raw"
    root.mkdir()
    log, users = _click_log(rng), _users(rng)
    pq.write_table(log, root / "log.parquet")
    pq.write_table(users, root / "users.parquet")
    written = write_buckets(root / "log.parquet", "user_id", BUCKETS, root / "log",
                            rows_per_group=ROWS_PER_GROUP)
    assert written["rows_per_bucket"] == [ROWS_PER_BUCKET] * BUCKETS
    write_buckets(root / "users.parquet", "user_id", BUCKETS, root / "users",
                  rows_per_group=64)
    (root / "derive.py").write_text(TRANSFORM)
    ns = types.SimpleNamespace(root=root, table=log, rng=rng, log=str(root / "log"),
                               users=str(root / "users"),
                               transform=f"{root / 'derive.py'}:derive")
    ns.args = ["--data", ns.log, "--join", f"user_id={ns.users}", "--transform", ns.transform]
    return ns


def _marker(directory, step: int) -> dict:
    """The verified marker of checkpoint `step` in `directory`."""
    return checkpoint.read_train_state(checkpoint.checkpoint_path(str(directory), step))


def _metrics(path) -> dict:
    with open(path) as f:
        return json.load(f)


def _logs(tmp_path, name):
    folder = tmp_path / name
    folder.mkdir()
    return folder


def _check_model_of_the_table(m: dict) -> None:
    """The model is the table's after the join and the transform: one table per id column,
    the users table's segment and the derived column included; held out: 2 row groups."""
    assert set(m["plan"]) == {"t_user_id", "t_item_id", "t_country", "t_segment",
                              f"t_{DERIVED}"}, m["plan"]
    assert m["eval_examples"] == HELD_OUT_EXAMPLES and "--eval-fraction 0.1" in m["eval_data"]
    assert 0.0 <= m["auc"] <= 1.0 and 0.2 < m["eval_loss"] < 2.0


@pytest.mark.distributed
def test_killed_and_resumed_equals_uninterrupted(raw, tmp_path):
    """2 ranks on the bucketed log with --join and --transform: a run killed after step 13
    (checkpoints every 4 steps) and resumed from its step-12 checkpoint, into the second epoch
    (a new order of buckets and row groups) at step 14, ends with the state, bit for bit
    (state_sha256: the generators' states too), and the held-out figures of a run that was
    never stopped. Read by the default loader (a worker process per rank)."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert 12 < EPOCH_STEPS < 16
    run = [*FP32, *raw.args, "--steps", "16", "--checkpoint-every", "4"]
    launch_ranks([*run, "--checkpoint-dir", str(a), "--metrics", str(tmp_path / "a.json")],
                 _logs(tmp_path, "uninterrupted"))
    _killed_run([*run, "--checkpoint-dir", str(b)], tmp_path, "killed", "step 13", {0, 1})
    assert checkpoint.latest_checkpoint(str(b))[0] == 12
    ranks = launch_ranks([*run, "--checkpoint-dir", str(b), "--resume", "--metrics",
                          str(tmp_path / "b.json")], _logs(tmp_path, "resumed"))
    assert "steps 12..16" in ranks[0].output()

    for step in (12, 16):
        want, got = _marker(a, step), _marker(b, step)
        assert got["state_sha256"] == want["state_sha256"], step
        assert got["data_fingerprint"] == want["data_fingerprint"] is not None
        assert got["data_snapshots"] == [None, None]  # Parquet: nothing to pin
    # Steps 12..16 changed the state: the equality above is not vacuous.
    assert _marker(a, 12)["state_sha256"] != _marker(a, 16)["state_sha256"]
    ma, mb = _metrics(tmp_path / "a.json"), _metrics(tmp_path / "b.json")
    _check_model_of_the_table(ma)
    assert mb["resumed_from_step"] == 12
    for key in ("auc", "eval_loss", "eval_examples", "tables"):
        assert ma[key] == mb[key], key


def _set_data_snapshots(folder: str, snapshots) -> None:
    """Rewrite the marker of checkpoint `folder` to name other snapshots (the marker is not
    among the files its checksums cover: it still verifies)."""
    path = os.path.join(folder, checkpoint.STATE_FILE)
    with open(path) as f:
        marker = json.load(f)
    assert checkpoint.STATE_FILE not in marker["files"]
    with open(path, "w") as f:
        json.dump({**marker, "data_snapshots": snapshots}, f)
    checkpoint_files.verify(folder)


def _check_same_training(start: dict, want: dict, got: dict) -> None:
    """Two checkpoints (flattened, test_train_checkpoint._load) hold the same tables, dense
    layers, optimizer states and generators, bit for bit, which training from `start`
    changed."""
    assert want.keys() == got.keys()
    tensors = [k for k, v in want.items() if torch.is_tensor(v)]
    trained = [k for k in tensors if k.startswith(("model.", "optimizer.state."))]
    assert len(trained) > 10 and int(got["train.steps_done"]) == int(want["train.steps_done"])
    for k in tensors:
        assert torch.equal(want[k], got[k]), k
    assert all(not torch.equal(start[k], want[k]) for k in trained
               if k.startswith("model.") and "embedding_bags" in k)


def test_starting_the_loader_leaves_the_saved_generator_alone(raw):
    """The checkpoint saves each rank's torch generator so that a resumed run draws what the
    uninterrupted one draws. Starting the --data loader at a position must not draw from it:
    a resumed run starts its loader after the generator is restored, the uninterrupted one
    before the checkpoint was saved."""
    data = TrainData(parse_config([*MODEL, *raw.args]), 0, 2)
    try:
        torch.manual_seed(raw.rng.integers(1 << 31))
        before = torch.get_rng_state()
        next(data.train(4, 6))
        assert torch.equal(torch.get_rng_state(), before)
    finally:
        data.close()


# ---------------------------------------------------------------------------------------------
# Iceberg.

def _iceberg_log(raw) -> types.SimpleNamespace:
    """The click log as an Iceberg table ns.log in a SQL catalog on SQLite, partitioned by
    bucket(user_id, BUCKETS), written in ROWS_PER_GROUP-row groups."""
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.transforms import BucketTransform

    folder = raw.root / "catalog"
    folder.mkdir()
    db = folder / "catalog.db"
    catalog = SqlCatalog("default", uri=f"sqlite:///{db}", warehouse=f"file://{folder}/warehouse")
    catalog.create_namespace("ns")
    table = catalog.create_table("ns.log", schema=raw.table.schema, properties={
        "write.parquet.row-group-limit": str(ROWS_PER_GROUP)})
    with table.update_spec() as spec:
        spec.add_field("user_id", BucketTransform(BUCKETS), "user_id_bucket")
    table = catalog.load_table("ns.log")
    table.append(raw.table)
    return types.SimpleNamespace(catalog=catalog, ref=f"iceberg:sqlite:///{db}#ns.log",
                                 snapshot=table.current_snapshot().snapshot_id)


@pytest.mark.distributed
def test_iceberg_resume_reads_the_pinned_snapshot(raw, tmp_path, capsys, monkeypatch):
    """The log as an Iceberg table (bucketed by user_id, joined with the bucketed users folder):
    the checkpoint records the snapshot read; rows appended before the resume are not read, and
    the resumed run ends as the uninterrupted one. A snapshot expired since, or one the
    checkpoint names that never existed, is an error naming it."""
    ice = _iceberg_log(raw)
    args = ["--data", ice.ref, *raw.args[2:]]  # the same --join and --transform
    a, b = tmp_path / "a", tmp_path / "b"
    run = [*FP32, *args, "--steps", "6", "--checkpoint-every", "3"]
    launch_ranks([*run, "--checkpoint-dir", str(a), "--metrics", str(tmp_path / "a.json")],
                 _logs(tmp_path, "uninterrupted"))
    at3 = _marker(a, 3)
    assert at3["data_snapshots"] == [ice.snapshot, None]  # the log's; the join is Parquet
    _check_model_of_the_table(_metrics(tmp_path / "a.json"))

    # Rows appended after the checkpoint: the table's current snapshot has them ...
    later = _click_log(raw.rng, first_timestamp=1_800_000_000)
    table = ice.catalog.load_table("ns.log")
    table.append(later)
    appended = ice.catalog.load_table("ns.log").current_snapshot().snapshot_id
    assert appended != ice.snapshot
    fresh = parse_config([*run, "--checkpoint-dir", str(tmp_path / "fresh")])
    assert current_snapshots(fresh) == [appended, None]
    now = TrainData(fresh, 0, 2)
    pinned = TrainData(fresh, 0, 2, [ice.snapshot, None])
    assert now.raw.info.num_rows == 2 * pinned.raw.info.num_rows == 2 * raw.table.num_rows
    assert now.fingerprint != pinned.fingerprint == at3["data_fingerprint"]

    # ... a resume from step 3 reads the checkpoint's, and ends as the uninterrupted run.
    b.mkdir()
    shutil.copytree(checkpoint.checkpoint_path(str(a), 3), checkpoint.checkpoint_path(str(b), 3))
    ranks = launch_ranks([*run, "--checkpoint-dir", str(b), "--resume", "--metrics",
                          str(tmp_path / "b.json")], _logs(tmp_path, "resumed"))
    assert "steps 3..6" in ranks[0].output()
    assert (f"--resume reads what the checkpoint pinned: --data {ice.ref} at snapshot "
            f"{ice.snapshot}\n") in ranks[0].output()
    assert _marker(b, 6)["data_snapshots"] == [ice.snapshot, None]
    _check_same_training(*(_load(checkpoint.checkpoint_path(str(d), step), tmp_path, name)
                           for d, step, name in ((a, 3, "a3"), (a, 6, "a6"), (b, 6, "b6"))))
    ma, mb = _metrics(tmp_path / "a.json"), _metrics(tmp_path / "b.json")
    for key in ("auc", "eval_loss", "eval_examples"):
        assert ma[key] == mb[key], key

    # A checkpoint naming a snapshot that never existed.
    monkeypatch.setenv("LOCAL_RANK", "0")
    bogus = tmp_path / "bogus"
    bogus.mkdir()
    folder = checkpoint.checkpoint_path(str(bogus), 3)
    shutil.copytree(checkpoint.checkpoint_path(str(a), 3), folder)
    missing = ice.snapshot ^ 0x5A5A5A5A
    assert missing not in (ice.snapshot, appended)
    _set_data_snapshots(folder, [missing, None])
    err = _parse_error(capsys, [*run, "--checkpoint-dir", str(bogus), "--resume"])
    assert err.startswith("recxla-train: error: --data: ") and ice.ref in err, err
    assert f"snapshot {missing} no longer exists" in err, err

    # The pinned snapshot expired: the resume says so, naming it, instead of reading another.
    ice.catalog.load_table("ns.log").maintenance.expire_snapshots().by_id(ice.snapshot).commit()
    err = _parse_error(capsys, [*run, "--checkpoint-dir", str(b), "--resume-step", "3",
                                "--resume"])
    assert f"snapshot {ice.snapshot} no longer exists" in err, err
    assert str(appended) in err  # the snapshots the table still has


# ---------------------------------------------------------------------------------------------
# Errors before training.

def _unit_of(raw, row: int):
    """(bucket file, row group) of the log's row `row` in the bucketed folder: write_buckets
    keeps each bucket's rows in source order, ROWS_PER_GROUP to a group."""
    keys = raw.table.column("user_id")
    buckets = bucket_of(keys, BUCKETS)
    b = int(buckets[row])
    position = int(np.count_nonzero(buckets[:row] == b))
    return os.path.join(raw.log, f"user_id_bucket={b}", "part-00000.parquet"), \
        position // ROWS_PER_GROUP


def test_a_transform_that_raises_exits_2_naming_the_transform_and_the_unit(raw, tmp_path):
    """On 2 ranks: the transform raises on one row group (the one holding a chosen row), found
    while each rank plans the table before any process group: every rank exits 2; the first
    rank prints the transform, the file and the row group, once."""
    row = int(raw.rng.integers(ROWS_PER_GROUP, raw.table.num_rows))
    stamp = raw.table.column("timestamp")[row].as_py()
    (raw.root / "explode.py").write_text(
        "import pyarrow.compute as pc\n\n\n"
        "def explode(batch):\n"
        f"    if pc.any(pc.equal(batch.column('timestamp'), {stamp})).as_py():\n"
        "        raise ZeroDivisionError('no price for this row')\n"
        "    return batch\n")
    name = f"{raw.root / 'explode.py'}:explode"
    ranks = start_ranks([*MODEL, "--data", raw.log, "--join", f"user_id={raw.users}",
                         "--transform", raw.transform, "--transform", name, "--steps", "4"],
                        _logs(tmp_path, "ranks"))
    assert wait_ranks(ranks, 120) == [2, 2], ranks[0].output()[-3000:]
    out = [r.output() for r in ranks]
    path, group = _unit_of(raw, row)
    want = (f"recxla-train: error: --data: recxla.data.transforms: transform {name} raised on "
            f"{raw.log}: {path} row group {group}: ZeroDivisionError: no price for this row")
    assert [line for line in out[0].splitlines() if "error" in line] == [want], out[0][-3000:]
    assert "error" not in out[1], out[1][-3000:]  # the node's second rank exits quietly


def _rebucketed_users(raw, n: int) -> str:
    out = raw.root / f"users_{n}"
    write_buckets(raw.root / "users.parquet", "user_id", n, out, rows_per_group=64)
    return str(out)


# (what, argv of the raw table's fixture namespace, the message's parts)
ERRORS = [
    ("a missing transform module",
     lambda raw: [*raw.args[:4], "--transform", "no_such_transform_module:derive"],
     lambda raw: ["--data: recxla.data.transforms: transform "
                  "'no_such_transform_module:derive': no module 'no_such_transform_module'"]),
    ("a missing transform file",
     lambda raw: [*raw.args[:4], "--transform", f"{raw.root / 'nowhere.py'}:derive"],
     lambda raw: [f"{raw.root / 'nowhere.py'}: no such file"]),
    ("feature table in 3 buckets, log in 2",
     lambda raw: ["--data", raw.log, "--join", f"user_id={_rebucketed_users(raw, 3)}"],
     lambda raw: [f"join on 'user_id': the training table {raw.log} is in 2 bucket(s) of "
                  f"'user_id', the feature table {raw.root / 'users_3'} in 3"]),
    ("join key not in the feature table",
     lambda raw: ["--data", raw.log, "--join", f"item_id={raw.users}"],
     lambda raw: [f"join of the training table {raw.log} with the feature table "
                  f"{raw.users} on 'item_id': the feature table {raw.users} has no column "
                  "'item_id'"]),
    ("--model history on a table that names no history",
     lambda raw: [*raw.args, "--model", "history"],
     lambda raw: [f"--model history: reads one user history; --data {raw.log} names none",
                  "history_of"]),
    ("--max-rows with a raw table",
     lambda raw: [*raw.args, "--max-rows", "1000"],
     lambda raw: [f"--data: {raw.log}: a raw table gives its own model",
                  "--profile/--max-rows apply to converted datasets"]),
]


@pytest.mark.parametrize("what, argv, message", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_raw_table_options_exit_2(raw, capsys, monkeypatch, what, argv, message):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = _parse_error(capsys, [*MODEL, *argv(raw), "--steps", "4"])
    assert err.startswith("recxla-train: error: ") and err.count("\n") == 1, err
    for part in message(raw):
        assert part in err, (what, err)


def test_resume_with_another_transform_names_it(raw):
    """A checkpoint's run read the table through one transform; a resume through another is
    refused, naming --transform (check_compatible, which the trainer runs before training)."""
    (raw.root / "other.py").write_text(TRANSFORM.replace("1.0", "2.0"))
    config = parse_config([*MODEL, *raw.args, "--steps", "8"])
    data = TrainData(config, 0, 2)
    state = {"world_size": 2, "path": "recxla", "steps_done": 4, "config": config.asdict(),
             "data_fingerprint": data.fingerprint, "data_snapshots": data.snapshots}
    checkpoint.check_compatible(config, 2, state)  # the same run: fine
    other = parse_config([*MODEL, *raw.args[:4], "--transform", f"{raw.root / 'other.py'}:derive",
                          "--steps", "8"])
    with pytest.raises(ValueError) as refused:
        checkpoint.check_compatible(other, 2, state)
    assert "--transform" in str(refused.value), str(refused.value)


def test_resume_with_another_join_names_it(raw, tmp_path, capsys, monkeypatch):
    """A checkpoint whose run read the log without a join (one snapshot recorded), resumed with
    --join: the preflight reads the table as the options say (the checkpoint's snapshots do
    not fit them), and the resume check refuses, naming --join."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    alone = parse_config([*MODEL, "--data", str(raw.log), "--steps", "8"])
    data = TrainData(alone, 0, 2)
    state = {"world_size": 2, "path": "recxla", "steps_done": 4, "config": alone.asdict(),
             "data_fingerprint": data.fingerprint, "data_snapshots": data.snapshots}
    _set_data_snapshots(_write_checkpoint(tmp_path / "ckpt", 4), [None])
    joined = parse_config([*MODEL, *raw.args, "--steps", "8", "--checkpoint-dir",
                           str(tmp_path / "ckpt"), "--resume"])
    with pytest.raises(ValueError) as refused:
        checkpoint.check_compatible(joined, 2, state)
    assert "--join" in str(refused.value), refused.value


@pytest.mark.distributed
def test_torchrec_baseline_trains_the_raw_table(raw, tmp_path):
    """--baseline torchrec reads the same joined and transformed table, and reports its
    held-out AUC."""
    path = tmp_path / "torchrec.json"
    ranks = launch_ranks([*MODEL, *raw.args, "--baseline", "torchrec", "--steps", "4",
                          "--metrics", str(path)], _logs(tmp_path, "torchrec"))
    # Rank 0 says which role each column took, as a conversion does.
    assert f"column '{DERIVED}': sparse feature {DERIVED}" in ranks[0].output()
    assert "column 'price': dense 0" in ranks[0].output()
    m = _metrics(path)
    assert m["path"] == "torchrec" and m["world_size"] == 2
    assert m["config"]["join"] == [f"user_id={raw.users}"]
    assert m["config"]["transform"] == [raw.transform]
    _check_model_of_the_table(m)


@pytest.mark.distributed
def test_history_model_trains_a_tables_list_column(raw, tmp_path):
    """--model history on a raw table whose list column the schema marks `history_of`: the
    column becomes the EmbeddingCollection's table (recxla's module counts its bytes), the
    other columns keep their inferred roles, and TorchRec's baseline trains the same model."""
    rng = raw.rng
    lengths = rng.integers(0, 13, raw.table.num_rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    recent = pa.ListArray.from_arrays(pa.array(offsets),
                                      pa.array(rng.integers(0, ITEMS, offsets[-1])))
    pq.write_table(raw.table.append_column("recent", recent), raw.root / "histories.parquet")
    write_buckets(raw.root / "histories.parquet", "user_id", BUCKETS, raw.root / "histories",
                  rows_per_group=ROWS_PER_GROUP)
    schema = raw.root / "history.toml"
    schema.write_text('[sparse.recent]\nhistory_of = "item_id"\n')
    args = [*MODEL, "--data", str(raw.root / "histories"), "--join", f"user_id={raw.users}",
            "--schema", str(schema), "--model", "history", "--steps", "4"]
    launch_ranks([*args, "--metrics", str(tmp_path / "recxla.json")], _logs(tmp_path, "rx"))
    launch_ranks([*args, "--baseline", "torchrec", "--metrics", str(tmp_path / "torchrec.json")],
                 _logs(tmp_path, "tr"))
    rx, tr = _metrics(tmp_path / "recxla.json"), _metrics(tmp_path / "torchrec.json")
    for m in (rx, tr):  # the same tables: the list column's among them
        assert set(m["plan"]) == {"t_user_id", "t_item_id", "t_country", "t_segment",
                                  "t_recent"}, m["plan"]
    stats = rx["sharder_comm_stats_per_step"]
    assert stats["sequence_id_bytes_sent"] > 0 and stats["sequence_embedding_bytes_sent"] > 0
    for m in (rx, tr):
        assert m["eval_examples"] == HELD_OUT_EXAMPLES and 0.2 < m["eval_loss"] < 2.0


def test_info_tells_what_a_raw_table_becomes(raw, capsys):
    """`python -m recxla.data info` on a bucketed raw folder (no .parquet directly in it),
    with the trainer's --join and --transform: the rows, each column's role and the spec."""
    from recxla.data.__main__ import main as data_main

    assert data_main(["info", raw.log, "--join", f"user_id={raw.users}", "--transform",
                      raw.transform]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["raw_table"] == raw.log and info["rows"] == raw.table.num_rows
    assert info["row_groups"] == BUCKETS * ROWS_PER_BUCKET // ROWS_PER_GROUP
    assert any(line.startswith(f"column '{DERIVED}': sparse feature") for line in info["roles"])
    assert set(info["spec"]["sparse_features"]) == {"user_id", "item_id", "country", "segment",
                                                    DERIVED}


def test_a_split_of_whole_buckets_says_what_it_holds_out(raw, monkeypatch):
    """--eval-fraction holds out whole row groups: on a log bucketed into one row group a bucket
    it holds out half the rows, and says so, with the advice; on the fixture's small groups it
    holds out about what was asked, and says nothing."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    coarse = raw.root / "coarse"
    write_buckets(raw.root / "log.parquet", "user_id", BUCKETS, coarse,
                  rows_per_group=ROWS_PER_BUCKET)
    data = TrainData(parse_config([*MODEL, "--data", str(coarse), "--steps", "4"]), 0, 1)
    warning = data.split_warning()
    assert warning.startswith(f"--eval-fraction 0.1 holds out 50.0% of the rows: 1 whole row "
                              f"groups of up to {ROWS_PER_BUCKET:,} rows"), warning
    assert "--rows-per-group" in warning
    assert "50.0% of the rows" in data.held_out_description
    fine = TrainData(parse_config([*MODEL, "--data", raw.log, "--steps", "4"]), 0, 1)
    assert fine.split_warning() is None
    assert "12.5% of the rows" in fine.held_out_description


# A transform slow in rank 1's loader worker alone, once: longer than --timeout on one batch.
SLOW_TIMEOUT = 10.0
SLOW_ONCE = f'''
import os
import time

import torch.utils.data

_slept = []


def slow_once(batch):
    if torch.utils.data.get_worker_info() is not None and os.environ.get("RANK") == "1" \\
            and not _slept:
        _slept.append(True)
        time.sleep({1.6 * SLOW_TIMEOUT})
    return batch
'''


def test_a_batch_slower_than_the_timeout_from_a_live_worker_is_no_hang(raw, tmp_path):
    """Rank 1's loader worker takes 1.6 x --timeout over one batch while rank 0 waits for rank
    1 in the step's collectives: the run finishes (once it ended with exit 4, a 'deadlock'),
    and rank 1 says what it waited for."""
    (raw.root / "slow.py").write_text(SLOW_ONCE)
    ranks = launch_ranks([*MODEL, *raw.args, "--transform", f"{raw.root / 'slow.py'}:slow_once",
                          "--steps", "3", "--timeout", str(SLOW_TIMEOUT)],
                         _logs(tmp_path, "slow"), timeout=150 + 1.6 * SLOW_TIMEOUT)
    out = ranks[1].output()
    assert "\nrecxla-train: rank 1: waiting " in out, out[-3000:]
    assert "s for loader worker 0 (pid " in out and "it is alive" in out, out[-3000:]


FAILS_ON_RANK_1 = '''
import os

import torch.utils.data


def fails(batch):
    if torch.utils.data.get_worker_info() is not None and os.environ.get("RANK") == "1":
        raise ValueError("no price for this row")
    return batch
'''


def test_an_error_in_a_loader_worker_is_one_line_on_each_rank(raw, tmp_path):
    """A transform raises in rank 1's loader worker during training: rank 1 prints one line
    naming the worker, the table, the transform and the original error (the tracebacks go to
    a file it names), and rank 0 prints that line after "rank 1 failed: ", on a line of its
    own; neither prints a traceback."""
    (raw.root / "fails.py").write_text(FAILS_ON_RANK_1)
    name = f"{raw.root / 'fails.py'}:fails"
    ranks = start_ranks([*MODEL, *raw.args, "--transform", name, "--steps", "4"],
                        _logs(tmp_path, "ranks"))
    codes = wait_ranks(ranks, 150)
    out = [r.output() for r in ranks]
    assert codes == [3, 1], "\n".join(o[-3000:] for o in out)
    error = (r"recxla.data: loader worker 0 \(pid \d+\) failed reading \S+ \(epoch 0, shuffle "
             r"window \d+, rows \d+..\d+ of this rank's share\): TransformError: "
             rf"recxla.data.transforms: transform {re.escape(name)} raised on {raw.log}: \S+ "
             r"row group \d+: ValueError: no price for this row")
    mine = re.search(rf"\nrecxla-train: rank 1: error: {error}\nrecxla-train: rank 1: the "
                     r"tracebacks: (\S+)\n", out[1])
    assert mine, out[1][-3000:]
    with open(mine.group(1)) as f:
        saved = f.read()
    os.remove(mine.group(1))
    assert 'raise ValueError("no price for this row")' in saved, saved
    assert re.search(rf"\nrecxla-train: rank 0: exiting: rank 1 failed: {error}( \(this rank "
                     r"saw: [^\n]*\))?\n", out[0]), out[0][-3000:]
    assert all("Traceback" not in o for o in out), out
