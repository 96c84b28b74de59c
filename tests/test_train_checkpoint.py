"""Checkpoint and resume: a run stopped after a checkpoint and resumed ends bit for bit where an
uninterrupted run ends (CPU, fp32 communication): tables, dense layers, the fused embedding
optimizer's state, the dense optimizer's state. And, read from checkpoints: the recxla path and
the TorchRec baseline train the same model. The checkpoint folder's protocol on fake folders:
which are committed, which of those verify against their marker (a torn or changed file, a
missing, foreign or checksum-less marker do not, and are kept), what is removed (uncommitted
folders only), what pruning keeps. (Kills during training: test_train_crash_consistency;
damaged and planted files on resume: test_train_checkpoint_reader.)"""

import json
import os
import shutil

import pytest
import torch
from test_train_cli import SMALL, launch_ranks
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from recxla.train import checkpoint, checkpoint_files
from recxla.train.parse import parse_config

FP32 = [*SMALL, "--fwd-comm", "fp32", "--bwd-comm", "fp32", "--dense-allreduce", "fp32",
        "--warmup-steps", "1", "--sparse-optimizer", "rowwise_adagrad", "--dense-optimizer",
        "adagrad"]


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _load(folder, tmp_path, name):
    path = str(tmp_path / f"{name}.pt")
    dcp_to_torch_save(folder, path)
    return _flat(torch.load(path, weights_only=False))


# The default schedule, and DBP's early lookup with micro-batches: there the next batch is
# looked up before this step's update and corrected, while a resumed run looks it up after the
# update; the pipeline makes the lookup after a checkpoint the resumed run's.
# FP8 dense all-reduce: its error-feedback residuals are saved per rank and resume with it,
# on recxla's pipeline and as the DDP hook on TorchRec's; PowerSGD's residuals, factors and
# counts likewise (compressed from step 2, so the resumed steps 4..8 compress). Early rows:
# the pipeline runs two batches ahead and the next batch's rows left before the checkpoint;
# the resumed run sends them after the update, with the same values.
SCHEDULES = {"default": [], "early lookup, 2 micro-batches": ["--dbp-lookup", "early",
                                                               "--micro-batches", "2"],
             "early rows": ["--early-rows"],
             "fp8 dense all-reduce": ["--dense-allreduce", "fp8"],
             "fp8 dense all-reduce, torchrec": ["--baseline", "torchrec", "--dense-allreduce",
                                                "fp8"],
             "powersgd dense all-reduce": ["--dense-allreduce", "powersgd", "--powersgd-start",
                                           "2"]}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_resume_equals_uninterrupted(tmp_path, schedule):
    a, b = tmp_path / "a", tmp_path / "b"
    args = [*FP32, *SCHEDULES[schedule]]
    if "--baseline" in args:  # TorchRec's sharder has no recxla wire options
        for flag in ("--fwd-comm", "--bwd-comm"):
            at = args.index(flag)
            del args[at:at + 2]
    # One run of 8 steps, checkpointing after 4 and 8 ...
    launch_ranks([*args, "--steps", "8", "--checkpoint-every", "4", "--checkpoint-dir", str(a)],
                 tmp_path)
    assert checkpoint.latest_checkpoint(str(a))[0] == 8
    # ... and a run that stopped after step 4's checkpoint, resumed to 8.
    b.mkdir()
    shutil.copytree(checkpoint.checkpoint_path(str(a), 4), checkpoint.checkpoint_path(str(b), 4))
    ranks = launch_ranks([*args, "--steps", "8", "--checkpoint-dir", str(b), "--resume"],
                         tmp_path)
    assert "steps 4..8" in ranks[0].output()
    if "--early-rows" in args:  # rows did leave early in the resumed run
        assert "left before the update (--early-rows)" in ranks[0].output()

    at4 = _load(checkpoint.checkpoint_path(str(a), 4), tmp_path, "a4")
    end_a = _load(checkpoint.checkpoint_path(str(a), 8), tmp_path, "a8")
    end_b = _load(checkpoint.checkpoint_path(str(b), 8), tmp_path, "b8")
    assert end_a.keys() == end_b.keys()
    tensors = [k for k, v in end_a.items() if torch.is_tensor(v)]
    tables = [k for k in tensors if k.startswith("model.") and "embedding_bags" in k]
    fused_state = [k for k in tensors if k.startswith("optimizer.state.") and
                   "embedding_bags" in k]
    dense_state = [k for k in tensors if k.startswith("optimizer.state.") and "dense_arch" in k]
    assert len(tables) == 26 and len(fused_state) >= 26 and dense_state
    compressed = "fp8" if "fp8" in schedule else "powersgd" if "powersgd" in schedule else None
    residuals = [k for k in tensors if k.startswith("train.dense_")]
    assert all(k.startswith(f"train.dense_{compressed}_rank") for k in residuals), residuals
    assert bool(residuals) == bool(compressed), residuals
    for k in tensors:
        assert torch.equal(end_a[k], end_b[k]), k
    # Steps 4..8 did change every table and optimizer state (the equality above is not vacuous).
    for k in tables + fused_state + dense_state:
        assert not torch.equal(at4[k], end_a[k]), k
    assert any(not torch.equal(at4[k], end_a[k]) for k in residuals) or not residuals
    assert int(end_a["train.steps_done"]) == 8 and int(at4["train.steps_done"]) == 4


@pytest.mark.parametrize("sync", [["gradients"], ["weights", "--sync-every", "3"]])
def test_2d_resume_equals_uninterrupted(tmp_path, sync):
    """2 nodes x 2 ranks, each node a whole copy of the tables: the checkpoint holds one copy
    (DCP writes a shard that two nodes hold once), and a resumed run ends where the
    uninterrupted one ends. With --replica-sync weights the copies differ between syncs (every
    3 steps here; the checkpoint after 4 is not at one): the checkpoint averages them first, in
    the uninterrupted run too, so both runs train on from the same copies."""
    a, b = tmp_path / "a", tmp_path / "b"
    args = [*FP32, "--topology", "2d", "--ranks-per-node", "2", "--replica-sync", *sync]
    launch_ranks([*args, "--steps", "8", "--checkpoint-every", "4", "--checkpoint-dir", str(a)],
                 tmp_path, world_size=4, ranks_per_node=2)
    b.mkdir()
    shutil.copytree(checkpoint.checkpoint_path(str(a), 4), checkpoint.checkpoint_path(str(b), 4))
    ranks = launch_ranks([*args, "--steps", "8", "--checkpoint-dir", str(b), "--resume"],
                         tmp_path, world_size=4, ranks_per_node=2)
    assert "steps 4..8" in ranks[0].output()
    at4 = _load(checkpoint.checkpoint_path(str(a), 4), tmp_path, "a4")
    end_a = _load(checkpoint.checkpoint_path(str(a), 8), tmp_path, "a8")
    end_b = _load(checkpoint.checkpoint_path(str(b), 8), tmp_path, "b8")
    assert end_a.keys() == end_b.keys()
    tables = [k for k in end_a if k.startswith("model.") and "embedding_bags" in k]
    assert len(tables) == 26
    for k, config in zip(sorted(tables), sorted(_small_tables(), key=lambda c: c.name)):
        assert end_a[k].shape == (config.num_embeddings, config.embedding_dim), k
    for k in end_a:
        if torch.is_tensor(end_a[k]):
            assert torch.equal(end_a[k], end_b[k]), k
    for k in tables:
        assert not torch.equal(at4[k], end_a[k]), k
    # One copy of the tables on disk: about the 1D layout's bytes, not two nodes' worth.
    table_bytes = sum(end_a[k].numel() * end_a[k].element_size() for k in tables)
    written = sum(os.path.getsize(os.path.join(checkpoint.checkpoint_path(str(a), 8), f))
                  for f in os.listdir(checkpoint.checkpoint_path(str(a), 8)))
    assert table_bytes < written < 1.5 * 2 * table_bytes  # tables and their Adagrad state


def _small_tables():
    from recxla.train.data import TrainData

    return TrainData(parse_config(FP32), 0, 1).tables()


def test_recxla_and_torchrec_train_the_same_model(tmp_path):
    """With fp32 communication both paths apply the same updates: same initial tables, data,
    plan and optimizer (fused SGD), so after 3 steps every parameter agrees to float rounding.
    TorchRec's two pipelines (--baseline-pipeline) run the same ops in the same order, only
    scheduled apart: they agree bit for bit."""
    common = [*SMALL, "--steps", "3", "--warmup-steps", "1", "--sparse-optimizer", "sgd",
              "--sharding", "table_wise"]
    launch_ranks([*common, "--fwd-comm", "fp32", "--bwd-comm", "fp32", "--dense-allreduce",
                  "fp32", "--checkpoint-dir", str(tmp_path / "r")], tmp_path)
    launch_ranks([*common, "--baseline", "torchrec", "--checkpoint-dir", str(tmp_path / "t")],
                 tmp_path)
    launch_ranks([*common, "--baseline", "torchrec", "--baseline-pipeline", "sparse_dist_lite",
                  "--checkpoint-dir", str(tmp_path / "lite")], tmp_path)
    rx, tr, lite = (_load(checkpoint.checkpoint_path(str(tmp_path / name), 3), tmp_path, name)
                    for name in ("r", "t", "lite"))
    params = [k for k in rx if k.startswith("model.")]
    assert len(params) > 26
    for k in params:
        torch.testing.assert_close(rx[k], tr[k], rtol=1e-5, atol=1e-6 * float(tr[k].abs().max()))
        assert torch.equal(lite[k], tr[k]), k


@pytest.mark.parametrize("resumed_with", [
    ["--dense-allreduce", "powersgd", "--powersgd-start", "0", "--powersgd-rank", "2"],
    ["--dense-allreduce", "fp8"], ["--dense-allreduce", "bf16"]])
def test_resume_with_another_compressed_all_reduce_starts_its_state_anew(tmp_path, resumed_with):
    """A checkpoint of --dense-allreduce powersgd at rank 1 resumed with another rank (its
    factors have other shapes) or another wire: the new state starts anew; the run goes on
    and its next checkpoint holds that state."""
    args = [*SMALL, "--warmup-steps", "1", "--checkpoint-dir", str(tmp_path / "c")]
    launch_ranks([*args, "--steps", "3", "--dense-allreduce", "powersgd", "--powersgd-start",
                  "0"], tmp_path)
    ranks = launch_ranks([*args, "--steps", "5", "--resume", *resumed_with], tmp_path)
    assert "steps 3..5" in ranks[0].output()
    saved = _load(checkpoint.checkpoint_path(str(tmp_path / "c"), 5), tmp_path, "c5")
    wire = resumed_with[1]
    dense = {k for k in saved if k.startswith("train.dense_")}
    assert all(k.startswith(f"train.dense_{wire}_rank") for k in dense), dense
    assert bool(dense) == (wire != "bf16")
    if wire == "powersgd":
        assert any(k.endswith(".q") and saved[k].shape[1] == 2 for k in dense), dense


def test_resume_rejects_other_options(tmp_path):
    config = parse_config([*FP32, "--steps", "8"])
    state = {"steps_done": 4, "data_position": 4, "world_size": 2, "path": "recxla",
             "config": config.asdict()}
    checkpoint.check_compatible(config, 2, state)  # the same run: fine
    other = parse_config([*FP32, "--steps", "8", "--batch-size", "64"])
    with pytest.raises(ValueError, match=r"--batch-size 128 \(now 64\)"):
        checkpoint.check_compatible(other, 2, state)
    with pytest.raises(ValueError, match=r"world size 2 \(now 4\)"):
        checkpoint.check_compatible(config, 4, state)
    with pytest.raises(ValueError, match="nothing left to train"):
        checkpoint.check_compatible(parse_config([*FP32, "--steps", "4"]), 2, state)
    two_d = ["--topology", "2d", "--ranks-per-node", "2"]
    with pytest.raises(ValueError, match=r"--topology '1d' \(now '2d'\)"):
        checkpoint.check_compatible(parse_config([*FP32, "--steps", "8", *two_d]), 2, state)
    state_2d = dict(state, config=parse_config([*FP32, "--steps", "8", *two_d]).asdict())
    checkpoint.check_compatible(parse_config([*FP32, "--steps", "8", *two_d]), 2, state_2d)
    for other, message in ((["--ranks-per-node", "1"], r"--ranks-per-node 2 \(now 1\)"),
                           (["--replica-sync", "weights"], r"--replica-sync 'gradients' "
                                                           r"\(now 'weights'\)")):
        changed = parse_config([*FP32, "--steps", "8", "--topology", "2d", "--ranks-per-node",
                                "2", *other])
        with pytest.raises(ValueError, match=message):
            checkpoint.check_compatible(changed, 2, state_2d)
    # Outside 2D the node layout is no part of the checkpoint.
    checkpoint.check_compatible(parse_config([*FP32, "--steps", "8", "--ranks-per-node", "1"]),
                                2, state)


def _write_checkpoint(directory, step, *, commit=True):
    """A checkpoint folder the way save() leaves it: random data files, the marker (their sizes
    and checksums), the rename (commit=False: marked but still `.partial`)."""
    partial = checkpoint_files.partial_path(str(directory), step)
    os.makedirs(partial)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        size = int(torch.randint(1, 4096, ()))
        with open(os.path.join(partial, name), "wb") as f:
            f.write(torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes())
    checkpoint_files.write_marker(partial, {"steps_done": step})
    return checkpoint_files.commit(str(directory), step) if commit else partial


def test_committed_checkpoints_are_kept_and_only_leftovers_removed(tmp_path):
    """Every `step_<N>` folder is a committed checkpoint (the rename is the commit): one that
    does not match its marker was damaged since; verify() names the file and what is wrong,
    and it is never removed nor passed over. Only `.partial` and `.old` folders are removed."""
    path = lambda step: checkpoint.checkpoint_path(str(tmp_path), step)  # noqa: E731
    _write_checkpoint(tmp_path, 2)
    incomplete = [_write_checkpoint(tmp_path, 4, commit=False)]  # marked, never renamed
    damaged = {}
    _write_checkpoint(tmp_path, 6)
    with open(os.path.join(path(6), "__1_0.distcp"), "r+b") as f:
        f.truncate(1)
    damaged[6] = ("__1_0.distcp", r"has 1 bytes, train_state.json recorded \d+ at the commit: "
                  "truncated since")
    _write_checkpoint(tmp_path, 8)
    os.remove(os.path.join(path(8), checkpoint.STATE_FILE))
    damaged[8] = (checkpoint.STATE_FILE, "missing")
    _write_checkpoint(tmp_path, 10)
    marker = json.loads((tmp_path / "step_00000010" / checkpoint.STATE_FILE).read_text())
    (tmp_path / "step_00000010" / checkpoint.STATE_FILE).write_text(
        json.dumps({**marker, "steps_done": 12}))
    damaged[10] = (checkpoint.STATE_FILE, "names 12 steps done, not the folder's 10")
    _write_checkpoint(tmp_path, 12)
    with open(os.path.join(path(12), ".metadata"), "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    damaged[12] = (".metadata", "its sha256 is not the one train_state.json recorded")
    _write_checkpoint(tmp_path, 14)
    (tmp_path / "step_00000014" / checkpoint.STATE_FILE).write_text(json.dumps(
        {"steps_done": 14, "files": {n: 1 for n in os.listdir(path(14))}}))
    damaged[14] = (checkpoint.STATE_FILE, "records file sizes but no checksums")
    os.makedirs(path(16) + ".old")
    incomplete.append(path(16) + ".old")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "step_x").mkdir()

    assert checkpoint.latest_checkpoint(str(tmp_path)) == (14, path(14))  # never passed over
    assert checkpoint_files.committed_checkpoints(str(tmp_path)) == \
        [(s, path(s)) for s in (2, 6, 8, 10, 12, 14)]
    # Marker and sizes alone (no checksums): the .metadata with a changed byte passes.
    assert checkpoint_files.complete_checkpoints(str(tmp_path)) == [(2, path(2)), (12, path(12))]
    marker = checkpoint_files.verify(path(2))
    for step, (file, problem) in damaged.items():
        with pytest.raises(checkpoint_files.DamagedCheckpoint,
                           match=f"^checkpoint {path(step)}: {file}: {problem}"):
            checkpoint_files.verify(path(step))
    for name in ("notes.txt", "../step_00000006/.metadata"):
        with pytest.raises(ValueError, match=f": {name}: not one of the files "
                           "train_state.json lists"):
            checkpoint_files.check_file(path(2), marker, name)
    assert checkpoint_files.incomplete_folders(str(tmp_path)) == sorted(incomplete)
    assert checkpoint_files.remove_incomplete(str(tmp_path)) == sorted(incomplete)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", *(os.path.basename(path(s)) for s in
                                                           (2, 6, 8, 10, 12, 14)), "step_x"]
    # A commit of a step replaces the folder of that step (a run resumed from step 2 writing
    # step 6 anew).
    _write_checkpoint(tmp_path, 6)
    checkpoint_files.verify(path(6))


def test_prune_keeps_the_newest_and_never_a_newer_run(tmp_path):
    for step in (2, 4, 6, 8):
        _write_checkpoint(tmp_path, step)
    path = lambda step: checkpoint.checkpoint_path(str(tmp_path), step)  # noqa: E731
    assert checkpoint_files.prune(str(tmp_path), 6, None) == []
    # Just committed 6; 8 is another run's (more steps): left alone.
    assert checkpoint_files.prune(str(tmp_path), 6, 2) == [path(2)]
    assert [s for s, _ in checkpoint_files.complete_checkpoints(str(tmp_path))] == [4, 6, 8]
    assert checkpoint_files.prune(str(tmp_path), 6, 1) == [path(4)]
    with pytest.raises(ValueError, match="prune: keep must be >= 1"):
        checkpoint_files.prune(str(tmp_path), 6, 0)


def test_save_and_load_restore_the_generator_and_the_state(tmp_path):
    """In one process (a 1-rank gloo group): load() brings back the weights, the optimizer's
    state and the random generator's position of the save; the marker's fingerprint is the
    state's."""
    from test_train_cli import _free_port

    store = torch.distributed.TCPStore("127.0.0.1", _free_port(), 1, is_master=True)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
        model(torch.randn(7, 5)).sum().backward()
        optimizer.step()
        config = parse_config([*FP32, "--steps", "8"])
        folder = checkpoint.save(str(tmp_path), 4, model, optimizer, config, 1)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        saved_sums = [optimizer.state[p]["sum"].clone() for p in model.parameters()]
        draws = torch.rand(4)  # the generator's next numbers after the save
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model(torch.randn(7, 5)).sum().backward()
        optimizer.step()
        assert checkpoint.load(folder, model, optimizer) == 4
        # Everything as it was at the save: the marker's fingerprint says so too.
        assert checkpoint.state_fingerprint(checkpoint._contents(model, optimizer, 4, 0)) == \
            checkpoint.read_train_state(folder)["state_sha256"]
        assert torch.equal(torch.rand(4), draws)
        for k, v in model.state_dict().items():
            assert torch.equal(v, saved[k]), k
        for p, sums in zip(model.parameters(), saved_sums):
            assert torch.equal(optimizer.state[p]["sum"], sums)
    finally:
        torch.distributed.destroy_process_group()


def test_a_full_disk_says_so_and_keeps_the_committed_checkpoints(tmp_path, monkeypatch):
    """A write that fails for want of space (DCP and torch's zip writer say only "file write
    failed") is an OSError ENOSPC naming the folder and the bytes; another failure is raised as
    it was; the committed checkpoint is kept either way."""
    import errno
    import shutil

    import torch.distributed.checkpoint as dcp
    from test_train_cli import _free_port

    store = torch.distributed.TCPStore("127.0.0.1", _free_port(), 1, is_master=True)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = torch.nn.Linear(64, 32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        config = parse_config([*FP32, "--steps", "8"])
        committed = checkpoint.save(str(tmp_path), 2, model, optimizer, config, 1)

        def write_failed(*args, **kwargs):
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 0 "
                               "vs 8448\nPytorchStreamWriter failed writing file data/0")

        monkeypatch.setattr(dcp, "save", write_failed)
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=100))
        with pytest.raises(OSError, match=r"checkpoint 4: writing .*step_0+4.partial failed: no "
                           r"space left on the device \(100 bytes free, this rank's state needs "
                           r"[\d,]+\); the committed checkpoints are as they were") as e:
            checkpoint.save(str(tmp_path), 4, model, optimizer, config, 1)
        assert e.value.errno == errno.ENOSPC
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1 << 40))
        with pytest.raises(RuntimeError, match="PytorchStreamWriter failed writing file"):
            checkpoint.save(str(tmp_path), 4, model, optimizer, config, 1)
        assert checkpoint.read_train_state(committed)["steps_done"] == 2
    finally:
        torch.distributed.destroy_process_group()


def test_the_commit_is_durable_in_order(tmp_path, monkeypatch):
    """The marker reaches the disk before its name, the folder's entries before the rename that
    commits it, and the rename itself after it (fsync of the parent folder): what makes a
    committed checkpoint survive a power loss whole."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), tmp_path)))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.path.relpath(src, tmp_path), os.path.relpath(dst, tmp_path)))
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint_files.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint_files.os, "replace", replace)
    _write_checkpoint(tmp_path, 6)
    marker = os.path.join("step_00000006.partial", checkpoint.STATE_FILE)
    assert events == [
        ("fsync", marker + ".tmp"), ("rename", marker + ".tmp", marker),
        ("fsync", "step_00000006.partial"),
        ("rename", "step_00000006.partial", "step_00000006"), ("fsync", ".")]
