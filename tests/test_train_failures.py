"""A rank that dies, hangs or fails makes the others exit non-zero within --timeout, with a
message naming it (the rank hosting the store too); a NaN loss stops the run at its step; the
watchdog's own logic on a fake store."""

import math
import os
import signal
import threading
import time

import pytest
import torch
from test_train_cli import SMALL, start_ranks, wait_ranks

from recxla.train.loop import EXIT_NON_FINITE_LOSS, NonFiniteLoss, Progress, run_steps
from recxla.train.watchdog import (
    EXIT_PEER_FAILED,
    EXIT_STALLED,
    FAILURE_CHARS,
    Watchdog,
    intervals,
)

TIMEOUT = 12.0  # --timeout of these runs: the survivors must be gone within it


def _wait_for(rank, text: str, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while text not in rank.output():
        if rank.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"rank never printed {text!r}:\n{rank.output()[-3000:]}")
        time.sleep(0.1)


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_lost_rank_ends_the_others_in_time(tmp_path, how):
    ranks = start_ranks([*SMALL, "--steps", "100000", "--timeout", str(TIMEOUT)], tmp_path)
    try:
        _wait_for(ranks[0], "steps 0..100000")
        time.sleep(1.0)  # a few steps in
        victim = ranks[1].proc
        os.kill(victim.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        lost = time.monotonic()
        code = wait_ranks(ranks[:1], TIMEOUT + 30)[0]
        elapsed = time.monotonic() - lost
    finally:
        for r in ranks:
            if r.proc.poll() is None:
                r.proc.kill()  # SIGKILL also ends a stopped process
                r.proc.wait()
    out = ranks[0].output()
    assert code == EXIT_PEER_FAILED, out[-3000:]
    assert "rank 1 stopped responding" in out, out[-3000:]
    assert elapsed < TIMEOUT, f"rank 0 took {elapsed:.1f} s to exit"


def test_the_store_host_killed_ends_the_others_with_status_3(tmp_path):
    """Ranks started without torchrun: rank 0 hosts the store. Killed, it takes the store with
    it; rank 1 must still exit EXIT_PEER_FAILED naming what happened, with no traceback (its
    error handler asked the lost store who failed, and raised). A long --timeout spaces the
    watchdog's checks (1.5 s here), so that the training loop's failed collective, not the
    watchdog's thread, is what notices first, as in most real runs."""
    timeout = 60.0
    ranks = start_ranks([*SMALL, "--steps", "100000", "--timeout", str(timeout)], tmp_path)
    try:
        _wait_for(ranks[0], "steps 0..100000")
        time.sleep(1.0)  # a few steps in
        os.kill(ranks[0].proc.pid, signal.SIGKILL)
        lost = time.monotonic()
        code = wait_ranks(ranks[1:], timeout + 30)[0]
        elapsed = time.monotonic() - lost
    finally:
        for r in ranks:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
    out = ranks[1].output()
    assert code == EXIT_PEER_FAILED, out[-3000:]
    assert "lost the rendezvous store" in out and "rank 0" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert elapsed < timeout / 2, f"rank 1 took {elapsed:.1f} s to exit"


def test_a_nan_loss_stops_the_run_at_its_step(tmp_path):
    """A learning rate that blows the weights up gives a NaN (or infinite) loss within a few
    steps: the run stops there with the non-finite-loss status and a message saying what to
    check, instead of training on to `loss nan` and exit 0."""
    ranks = start_ranks([*SMALL, "--steps", "30", "--warmup-steps", "1", "--dense-lr", "1e30",
                         "--timeout", str(TIMEOUT), "--metrics", str(tmp_path / "m.json")],
                        tmp_path)
    codes = wait_ranks(ranks, 150)
    out = "\n".join(r.output() for r in ranks)
    # The rank that saw it first exits EXIT_NON_FINITE_LOSS; a peer either saw it too, or
    # exits EXIT_PEER_FAILED naming that rank.
    assert EXIT_NON_FINITE_LOSS in codes and set(codes) <= {EXIT_NON_FINITE_LOSS,
                                                             EXIT_PEER_FAILED}, out[-3000:]
    assert "error: the training loss is " in out and "Check the training data for NaN" in out
    assert "--dense-lr" in out and "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "m.json").exists()


class _Loss:
    """A loss the loop reads on the host (float()), counting the reads: on GPU each is a sync."""

    reads = 0

    def __init__(self, value: float):
        self.value = value

    def __float__(self):
        _Loss.reads += 1
        return self.value


class _Pipeline:
    def __init__(self, losses):
        self.losses = iter(losses)

    def progress(self, batches):
        next(batches)
        return _Loss(next(self.losses)), None, None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_run_steps_stops_at_the_first_non_finite_loss(bad):
    from recxla.train.comm_meter import CommMeter

    _Loss.reads = 0
    done = []
    losses = [0.7, 0.69, bad, 0.5, 0.5]
    with pytest.raises(NonFiniteLoss, match="the training loss is") as e:
        run_steps(_Pipeline(losses), iter(range(5)), 0, 5, CommMeter(), Progress(False, 5, 0, 1),
                  done.append)
    assert e.value.step == 3 and e.value.exit_status == EXIT_NON_FINITE_LOSS
    assert "0.7, 0.69" in str(e.value)  # the losses before it: divergence or a bad batch
    assert done == [1, 2]  # no on_step_done (checkpoint) after the bad step
    assert _Loss.reads == 3  # one host read of the loss per step: no sync added for the check
    # A finite run: still one read per step.
    _Loss.reads = 0
    log = run_steps(_Pipeline([0.5] * 4), iter(range(4)), 0, 4, CommMeter(),
                    Progress(False, 4, 0, 1), lambda n: None)
    assert log.loss == [0.5] * 4 and _Loss.reads == 4
    assert torch.isfinite(torch.tensor(log.loss)).all()


class FakeStore:
    """The Store calls the watchdog makes, on a dict, with a lock (two watchdogs share it)."""

    def __init__(self):
        self.data, self.lock = {}, threading.Lock()

    def set(self, key, value):
        with self.lock:
            self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        with self.lock:
            return self.data[key]

    def check(self, keys):
        with self.lock:
            return all(k in self.data for k in keys)

    def multi_get(self, keys):
        with self.lock:
            return [self.data[k] for k in keys]


def _watchdogs(world, timeout):
    store, exits, lines = FakeStore(), {}, []

    class Out:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass

    dogs = [Watchdog(store, r, world, timeout, out=Out(),
                     exit_fn=lambda code, r=r: exits.setdefault(r, code)) for r in range(world)]
    return store, dogs, exits, lines


def test_watchdog_names_a_rank_that_falls_silent():
    timeout = 4.0
    _, dogs, exits, lines = _watchdogs(3, timeout)
    for d in dogs:
        d.start()
    dogs[2].stop()  # rank 2's heartbeat stops: as if killed or stopped
    start = time.monotonic()
    while len(exits) < 2 and time.monotonic() - start < timeout + 2:
        for d in dogs[:2]:
            d.progress("step")
        time.sleep(0.05)
    for d in dogs:
        d.stop()
    assert exits == {0: EXIT_PEER_FAILED, 1: EXIT_PEER_FAILED}
    assert time.monotonic() - start < timeout
    assert all("rank 2 stopped responding" in m for m in (dogs[0].exit_message,
                                                          dogs[1].exit_message))


def _both_stall(dogs, exits, timeout: float) -> float:
    """Waits (up to timeout + 2 s) until both ranks' watchdogs have ended them, stops every
    watchdog, checks both ended as stalled; -> the seconds waited."""
    start = time.monotonic()
    while len(exits) < 2 and time.monotonic() - start < timeout + 2:
        time.sleep(0.05)
    waited = time.monotonic() - start
    for d in dogs:
        d.stop()
    assert exits == {0: EXIT_STALLED, 1: EXIT_STALLED}
    return waited


def test_watchdog_names_the_rank_behind_when_progress_stalls():
    timeout = 3.0
    _, dogs, exits, _ = _watchdogs(2, timeout)
    for d in dogs:
        d.start()
    for _ in range(3):
        dogs[0].progress("step 3")  # rank 0 moves on, then waits for rank 1 forever
    waited = _both_stall(dogs, exits, timeout)
    assert waited <= timeout
    assert "furthest behind: rank 1" in dogs[0].exit_message
    assert "rank 1 made no progress" in dogs[1].exit_message


def test_watchdog_reports_a_peer_failure_at_once():
    store, dogs, exits, _ = _watchdogs(2, 30.0)
    dogs[0].start()
    dogs[1].report_failure("ValueError: bad batch")
    assert dogs[0].culprit(wait=False) == "rank 1 failed: ValueError: bad batch"
    dogs[0].stop()
    assert not exits


class LostStore(FakeStore):
    """A store whose host is gone: every call raises, as torch's TCPStore client does."""

    def __init__(self):
        super().__init__()
        self.lost = False

    def _maybe_raise(self):
        if self.lost:
            raise RuntimeError("Connection reset by peer")

    def check(self, keys):
        self._maybe_raise()
        return super().check(keys)

    def get(self, key):
        self._maybe_raise()
        return super().get(key)

    def multi_get(self, keys):
        self._maybe_raise()
        return super().multi_get(keys)

    def set(self, key, value):
        self._maybe_raise()
        super().set(key, value)


def test_watchdog_names_a_lost_store_instead_of_raising():
    """The error handler asks `culprit()` who failed; with the store's host gone its answer is
    that, not an exception (which left the rank with status 1 and a traceback)."""
    store = LostStore()
    dog = Watchdog(store, 1, 2, 30.0, exit_fn=lambda code: None)
    dog.start()
    dog.stop()
    store.lost = True
    for wait in (False, True):
        message = dog.culprit(wait=wait)
        assert "lost the rendezvous store" in message and "rank 0" in message
    dog.report_failure("ValueError: x")  # best effort: no raise either


def test_intervals_fit_inside_the_timeout():
    for timeout in (1.0, 4.0, 12.0, 120.0, 3600.0):
        interval, dead, stall = intervals(timeout)
        assert 0 < interval < dead <= timeout / 2 and stall + 2 * interval == pytest.approx(
            timeout)


def test_a_wait_on_a_live_loader_is_progress_for_the_rank_and_its_peers():
    """Rank 1 waits for its loader worker, which is alive, longer than --timeout while rank 0
    waits for rank 1 in a collective (no progress of its own): neither exits, rank 1 says once
    what it waits for, and rank 0's heartbeat view shows it. Once the wait ends and nothing
    moves, both exit as stalled within --timeout."""
    timeout = 3.0
    _, dogs, exits, lines = _watchdogs(2, timeout)
    wait = {"on": ("loader worker 0 (pid 4242)", time.monotonic())}
    dogs[1].watch_waits(lambda: wait["on"])
    for d in dogs:
        d.start()
    time.sleep(1.6 * timeout)
    assert exits == {}, [d.exit_message for d in dogs]
    told = [line for line in lines if "waiting" in line]
    assert len(told) == 1 and told[0].startswith("\nrecxla-train: rank 1: waiting ")
    assert "for loader worker 0 (pid 4242) while in start-up: it is alive" in told[0]
    value = dogs[0]._seen[1][0].decode()
    assert value.split(" ", 3)[3].startswith("start-up; waiting ") and \
        value.endswith("s for loader worker 0 (pid 4242), alive"), value
    wait["on"] = None  # the batch came; then nothing moves any more
    waited = _both_stall(dogs, exits, timeout)
    assert waited <= timeout + 0.5


def test_a_probe_that_raises_is_no_wait():
    """The probe races the loader's close on the main thread: an exception from it counts as
    no wait (the rank stalls as it would without it), never as an error of the watchdog."""
    timeout = 2.0
    _, dogs, exits, _ = _watchdogs(1, timeout)
    dogs[0].watch_waits(lambda: 1 / 0)
    dogs[0].start()
    start = time.monotonic()
    while not exits and time.monotonic() - start < timeout + 2:
        time.sleep(0.05)
    dogs[0].stop()
    assert exits == {0: EXIT_STALLED} and time.monotonic() - start <= timeout + 0.5


def test_a_failure_reaches_the_peers_as_its_first_line():
    """A rank publishes the first line of its error, cut at FAILURE_CHARS from the end, never
    from the start (the peers once printed the last 2,000 characters of a traceback, starting
    mid-line), saying where the rest is."""
    store, dogs, _, _ = _watchdogs(2, 30.0)
    dogs[0].start()
    dogs[1].report_failure("ValueError: bad batch\nTraceback (most recent call last):\n  ...")
    assert dogs[0].culprit(wait=False) == ("rank 1 failed: ValueError: bad batch (rank 1's "
                                           "output has the rest)")
    long = "ValueError: " + "x" * 5000
    dogs[1].report_failure(long)
    got = dogs[0].culprit(wait=False)
    assert got == (f"rank 1 failed: {long[:FAILURE_CHARS - 3]}... (rank 1's output has the "
                   "rest)")
    dogs[0].stop()


def test_an_exit_message_starts_on_a_line_of_its_own():
    """Rank 0's progress bar (or another rank's output) may end without a newline: the exit
    message begins with one."""
    _, dogs, exits, lines = _watchdogs(2, 30.0)
    dogs[0].start()
    dogs[1].report_failure("ValueError: bad batch")
    start = time.monotonic()
    while not exits and time.monotonic() - start < 10:
        time.sleep(0.05)
    dogs[0].stop()
    assert exits == {0: EXIT_PEER_FAILED}
    assert lines[0] == "\nrecxla-train: rank 0: exiting: rank 1 failed: ValueError: bad batch"
