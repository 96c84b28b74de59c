"""A rank that dies, hangs or fails makes the others exit non-zero within --timeout, with a
message naming it; the watchdog's own logic on a fake store."""

import os
import signal
import threading
import time

import pytest
from test_train_cli import SMALL, start_ranks, wait_ranks

from recxla.train.watchdog import EXIT_PEER_FAILED, EXIT_STALLED, Watchdog, intervals

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


def test_watchdog_names_the_rank_behind_when_progress_stalls():
    timeout = 3.0
    _, dogs, exits, _ = _watchdogs(2, timeout)
    for d in dogs:
        d.start()
    for _ in range(3):
        dogs[0].progress("step 3")  # rank 0 moves on, then waits for rank 1 forever
    start = time.monotonic()
    while len(exits) < 2 and time.monotonic() - start < timeout + 2:
        time.sleep(0.05)
    for d in dogs:
        d.stop()
    assert exits == {0: EXIT_STALLED, 1: EXIT_STALLED}
    assert time.monotonic() - start <= timeout
    assert "furthest behind: rank 1" in dogs[0].exit_message
    assert "rank 1 made no progress" in dogs[1].exit_message


def test_watchdog_reports_a_peer_failure_at_once():
    store, dogs, exits, _ = _watchdogs(2, 30.0)
    dogs[0].start()
    dogs[1].report_failure("ValueError: bad batch")
    assert dogs[0].culprit(wait=False) == "rank 1 failed: ValueError: bad batch"
    dogs[0].stop()
    assert not exits


def test_intervals_fit_inside_the_timeout():
    for timeout in (1.0, 4.0, 12.0, 120.0, 3600.0):
        interval, dead, stall = intervals(timeout)
        assert 0 < interval < dead <= timeout / 2 and stall + 2 * interval == pytest.approx(
            timeout)
