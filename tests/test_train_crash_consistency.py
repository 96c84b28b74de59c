"""Crash consistency: kill -9 of one rank or every rank at any point, a checkpoint write
included, then `--resume`, ends bit for bit where an uninterrupted run ends (2 gloo ranks, CPU,
fp32 communication).

One uninterrupted run, then one checkpoint folder through a chain of runs, each killed at
another point (recxla.train.faults names them; the last kill comes from outside, at whatever
instant the checkpoint write has reached) and resumed by the next, the last one to the end.
After each kill the newest committed checkpoint is the one the kill point implies, and every
committed checkpoint verifies against its marker.
"""

import json
import os
import signal
import time

import torch
from test_train_checkpoint import FP32, _load
from test_train_cli import launch_ranks, start_ranks, wait_ranks

from recxla.train import checkpoint, checkpoint_files
from recxla.train.faults import KILL_AT_ENV

STEPS, EVERY = 8, 2
ARGS = [*FP32, "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--timeout", "20"]
KILLED = -signal.SIGKILL  # Popen's returncode of a process that SIGKILL ended


def _logs(tmp_path, name):
    folder = tmp_path / name
    folder.mkdir()
    return folder


def _killed_run(args, tmp_path, name, kill_at, killed_ranks):
    """Run the trainer with RECXLA_TRAIN_KILL_AT=kill_at; the ranks in `killed_ranks` must
    die by SIGKILL there, the others must exit with an error (their peer is gone)."""
    ranks = start_ranks(args, _logs(tmp_path, name), env={KILL_AT_ENV: kill_at})
    codes = wait_ranks(ranks, 150)
    detail = f"{name}: exit codes {codes}:\n" + "\n".join(r.output()[-2000:] for r in ranks)
    for r, code in enumerate(codes):
        assert code == KILLED if r in killed_ranks else code != 0, detail


def _latest_step(folder):
    latest = checkpoint.latest_checkpoint(str(folder))
    return None if latest is None else latest[0]


def _partial(folder, step):
    return checkpoint_files.partial_path(str(folder), step)


def test_kill_anywhere_then_resume_ends_bit_for_bit(tmp_path):
    ref, crash = tmp_path / "reference", tmp_path / "crash"
    launch_ranks([*ARGS, "--checkpoint-dir", str(ref), "--metrics", str(tmp_path / "ref.json")],
                 _logs(tmp_path, "reference"))
    fresh = [*ARGS, "--checkpoint-dir", str(crash)]
    resume = [*fresh, "--resume"]

    # Every rank killed inside the first checkpoint's write: nothing to resume from.
    _killed_run(fresh, tmp_path, "first-write", "checkpoint 2 writing", {0, 1})
    assert _latest_step(crash) is None and os.path.isdir(_partial(crash, 2))
    # A fresh start over the leftovers; rank 1 killed inside the second checkpoint's write.
    _killed_run(fresh, tmp_path, "one-rank-writing", "checkpoint 4 writing@1", {1})
    assert _latest_step(crash) == 2
    # Marked but not yet renamed (rank 0 between the marker and the commit): not a checkpoint.
    _killed_run(resume, tmp_path, "marked", "checkpoint 4 marked@0", {0})
    assert os.path.isfile(os.path.join(_partial(crash, 4), checkpoint.STATE_FILE))
    assert _latest_step(crash) == 2
    # Right after a checkpoint completes; then between checkpoints.
    _killed_run(resume, tmp_path, "committed", "checkpoint 4 committed", {0, 1})
    assert _latest_step(crash) == 4
    assert checkpoint_files.incomplete_folders(str(crash)) == []  # the save removed them
    _killed_run(resume, tmp_path, "between", "step 5", {0, 1})
    assert _latest_step(crash) == 4

    # Every rank killed from outside, at whatever point the write of checkpoint 6 has reached.
    ranks = start_ranks(resume, _logs(tmp_path, "outside"))
    deadline = time.monotonic() + 150
    # (Or just after it, if this process was not scheduled while the write lasted.)
    while not any(os.path.exists(p) for p in (_partial(crash, 6), checkpoint.checkpoint_path(
            str(crash), 6))) and time.monotonic() < deadline \
            and all(r.proc.poll() is None for r in ranks):
        time.sleep(0.005)
    for r in ranks:
        r.proc.send_signal(signal.SIGKILL)
    assert wait_ranks(ranks, 30) == [KILLED, KILLED], ranks[0].output()[-2000:]
    assert _latest_step(crash) in (4, 6)

    start = _latest_step(crash)
    last = launch_ranks([*resume, "--metrics", str(tmp_path / "crash.json")],
                        _logs(tmp_path, "last"))
    assert f"steps {start}..{STEPS}" in last[0].output()
    assert checkpoint_files.incomplete_folders(str(crash)) == []
    # Every checkpoint the chain committed verifies: each file's size and SHA-256, recorded by
    # the rank that wrote it, and DCP's metadata through the restricted unpickler.
    committed = checkpoint_files.committed_checkpoints(str(crash))
    assert [s for s, _ in committed] == list(range(EVERY, STEPS + 1, EVERY))
    for _, path in committed:
        checkpoint.read_train_state(path)

    ends = [checkpoint.checkpoint_path(str(d), STEPS) for d in (ref, crash)]
    expected, got = (_load(path, tmp_path, name) for path, name in zip(ends, ("a", "b")))
    assert expected.keys() == got.keys()
    for k, v in expected.items():
        if torch.is_tensor(v):
            assert torch.equal(v, got[k]), k
    markers = [checkpoint.read_train_state(path) for path in ends]
    assert markers[0]["state_sha256"] == markers[1]["state_sha256"]
    # The fingerprint changes with the state: the equality above is not vacuous.
    at4 = checkpoint.read_train_state(checkpoint.checkpoint_path(str(ref), 4))
    assert at4["state_sha256"] != markers[0]["state_sha256"]
    metrics = [json.loads((tmp_path / f"{n}.json").read_text()) for n in ("ref", "crash")]
    for key in ("auc", "eval_loss"):  # the held-out evaluation of the final model
        assert metrics[0][key] == metrics[1][key], key
