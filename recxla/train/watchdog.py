"""Watchdog: when a rank dies, hangs or fails, every other rank exits within --timeout, saying
which rank it was.

A collective that a peer never joins blocks its callers (gloo until its own timeout, NCCL
possibly forever), and when a peer dies gloo reports only "Connection closed by peer
<address>". So each rank runs a watchdog thread that talks through the rendezvous store
(torchrun's, which outlives the workers; or rank 0's):

- every `interval` seconds it publishes this rank's heartbeat: a beat count, the count of
  progress marks the training loop has made (`progress()`: a step done, a phase entered),
  whether it waits on a live helper (below) and where it is;
- it reads every peer's heartbeat and notes, in its own clock, when each last changed;
- a peer whose heartbeat has not changed for `dead_after` seconds is gone (killed, crashed or
  stopped): this rank prints "rank R stopped responding ..." and exits;
- when this rank's own loop has made no progress for `stall_after` seconds (it waits in a
  collective, or is stuck itself), it names the rank(s) furthest behind and exits;
- a rank whose loop raised publishes its error first (`report_failure`), and its peers exit
  at once with "rank R failed: <error>".
`stall_after` is `timeout` less two intervals, so every rank is gone within `timeout` of the
moment the job stopped moving.

A rank that waits on a helper of its own that is alive (a loader worker reading a slow batch:
`watch_waits`) is not stalled: the wait counts as progress, its heartbeat says so, and a peer
that waits for it in a collective takes that heartbeat as the job moving. A wait longer than
`timeout` is printed once; a worker that dies ends the wait (the loader raises, naming it).

Exits use os._exit: a thread blocked in a collective cannot be unwound, and a clean
process-group teardown would wait on the missing peer.

Exit status: EXIT_PEER_FAILED (3) when another rank caused the exit, EXIT_STALLED (4) when this
rank's own loop stopped.
"""

import os
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

EXIT_FAILED = 1
EXIT_PEER_FAILED = 3
EXIT_STALLED = 4
# The most of a failed rank's first line that its peers print.
FAILURE_CHARS = 1000


def intervals(timeout: float) -> Tuple[float, float, float]:
    """(heartbeat interval, dead_after, stall_after) in seconds for a --timeout."""
    interval = min(max(timeout / 40.0, 0.05), 2.0)
    # Generous: a heartbeat thread of a rank on a loaded machine can be late by a second or so.
    dead_after = min(max(6 * interval, 5.0), timeout / 2)
    return interval, dead_after, timeout - 2 * interval


class Watchdog:
    """Heartbeats of all ranks through a store; exits this process when the job stops.

    Args:
        store: a torch.distributed Store client of this rank's own (its calls must not queue
            behind the training loop's), private to this run (a PrefixStore).
        rank, world_size: this rank's place.
        timeout: seconds (see the module docstring).
        out: where the exit message goes (stderr).
        exit_fn: called with the exit status (os._exit; tests pass their own).
    """

    def __init__(self, store, rank: int, world_size: int, timeout: float, out=None,
                 exit_fn: Callable[[int], None] = os._exit):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout = timeout
        self.interval, self.dead_after, self.stall_after = intervals(timeout)
        self.out = out if out is not None else sys.stderr
        self.exit_fn = exit_fn
        self._beats = 0
        self._progress = 0
        self._where = "start-up"
        self._last_progress = time.monotonic()
        # peer -> (last value seen, monotonic time it changed)
        self._seen: Dict[int, Tuple[Optional[bytes], float]] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.exit_message: Optional[str] = None
        self._probe: Optional[Callable[[], Optional[Tuple[str, float]]]] = None
        self._waiting: Optional[Tuple[str, float]] = None  # this rank's live wait, if any
        self._told: Optional[float] = None  # the wait whose length was printed (its start)
        self._peer_waited = float("-inf")  # when a peer's heartbeat last said it waits

    def _key(self, what: str, rank: int) -> str:
        return f"{what}/{rank}"

    # -- called by the training loop ----------------------------------------------------------
    def start(self) -> "Watchdog":
        now = time.monotonic()
        self._last_progress = now
        self._seen = {r: (None, now) for r in range(self.world_size) if r != self.rank}
        self._publish()
        self._thread = threading.Thread(target=self._run, name="recxla-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval + 1)
            self._thread = None

    def progress(self, where: str) -> None:
        """The loop has moved on (a step is done, a phase begins); `where` names it."""
        self._progress += 1
        self._where = where
        self._last_progress = time.monotonic()

    def watch_waits(self, probe: Callable[[], Optional[Tuple[str, float]]]) -> None:
        """`probe()`, asked from the watchdog's thread every interval, returns (what, the
        time.monotonic() the wait began) while this rank's loop waits on a helper of its own
        that is alive (a loader worker making a batch), else None. Such a wait is progress."""
        self._probe = probe

    def report_failure(self, message: str) -> None:
        """Publish this rank's error so that its peers exit naming it (best effort): its
        first line, which the peers print after "rank R failed: ", cut at FAILURE_CHARS; the
        rest is in this rank's own output."""
        lines = message.strip().splitlines() or [""]
        first = lines[0]
        if len(first) > FAILURE_CHARS:
            first, lines = first[:FAILURE_CHARS - 3] + "...", lines + ["(cut)"]
        if len(lines) > 1:
            first += f" (rank {self.rank}'s output has the rest)"
        try:
            self.store.set(self._key("failed", self.rank), first)
        except Exception:  # the store may be gone too; the peers then see the silence
            pass

    def culprit(self, wait: bool = True) -> Optional[str]:
        """Why the job broke, naming the rank(s), if the heartbeats tell; with `wait`, keeps
        looking for up to dead_after + 2 intervals (a peer that just died is not silent yet)."""
        deadline = time.monotonic() + (self.dead_after + 2 * self.interval if wait else 0)
        while True:
            found = self._check_peers_or_store()
            if found is not None or time.monotonic() >= deadline:
                return found
            time.sleep(self.interval)

    # -- the thread ---------------------------------------------------------------------------
    def _publish(self) -> None:
        self._beats += 1
        where, waiting = self._where, self._waiting
        if waiting is not None:
            what, since = waiting
            where += f"; waiting {time.monotonic() - since:.0f} s for {what}, alive"
        self.store.set(self._key("beat", self.rank),
                       f"{self._beats} {self._progress} {int(waiting is not None)} {where}")

    def _check_wait(self) -> None:
        """Ask the probe: a live wait is progress; one longer than --timeout is told once."""
        try:
            waiting = self._probe() if self._probe is not None else None
        except Exception:  # a probe racing the loader's close: no wait to count
            waiting = None
        self._waiting = waiting
        if waiting is None:
            return
        what, since = waiting
        now = time.monotonic()
        self._last_progress = now
        if now - since > self.timeout and self._told != since:
            self._told = since
            print(f"\nrecxla-train: rank {self.rank}: waiting {now - since:.0f} s for {what} "
                  f"while in {self._where}: it is alive (a slow read or transform), so the run "
                  f"waits for it; --timeout {self.timeout:g} s ends hangs, not a live "
                  "loader", file=self.out, flush=True)

    def _peer_beats(self) -> List[Optional[bytes]]:
        keys = [self._key("beat", r) for r in self._seen]
        present = self.store.check(keys)
        if not present:
            return [self.store.get(k) if self.store.check([k]) else None for k in keys]
        return list(self.store.multi_get(keys))

    def _check_peers_or_store(self) -> Optional[str]:
        """`_check_peers`, or the lost store named when its calls fail: the store is gone when
        its host (rank 0, or torchrun's agent) died, and the error handler that asks must still
        exit with EXIT_PEER_FAILED, not raise."""
        try:
            return self._check_peers()
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""  # torch's may add a C++ trace
            return (f"lost the rendezvous store ({type(e).__name__}: {first}); the rank hosting "
                    "it (rank 0, or torchrun's agent) is gone")

    def _check_peers(self) -> Optional[str]:
        """A message naming the rank that failed or went silent, or None."""
        failed = [r for r in self._seen if self.store.check([self._key("failed", r)])]
        if failed:
            r = failed[0]
            return f"rank {r} failed: {self.store.get(self._key('failed', r)).decode()}"
        now = time.monotonic()
        silent = []
        for r, value in zip(list(self._seen), self._peer_beats()):
            old, since = self._seen[r]
            if value != old:
                self._seen[r] = (value, now)
                if value is not None and value.split(b" ", 3)[2:3] == [b"1"]:
                    self._peer_waited = now  # the peer waits on its live loader: moving
            elif now - since > self.dead_after:
                silent.append((r, now - since, old))
        if silent:
            parts = [f"rank {r} stopped responding (no heartbeat for {age:.1f} s; it was at: "
                     f"{_where(value)})" for r, age, value in silent]
            return "; ".join(parts)
        return None

    def _stalled_message(self, idle: float) -> str:
        progress = {}
        for r, (value, _) in self._seen.items():
            if value is not None:
                progress[r] = int(value.split()[1])
        behind = ""
        if progress:
            low = min(progress.values())
            if low < self._progress:
                ranks = sorted(r for r, p in progress.items() if p == low)
                behind = (f"; furthest behind: rank {', rank '.join(map(str, ranks))} (it was "
                          f"at: {_where(self._seen[ranks[0]][0])})")
            else:
                behind = "; every rank stopped at the same point (a deadlock, or this rank)"
        return (f"rank {self.rank} made no progress for {idle:.1f} s (limit: --timeout "
                f"{self.timeout:g} s) while in {self._where}{behind}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._check_wait()
            try:
                self._publish()
            except Exception:  # the store is gone: the check below names it
                pass
            message = self._check_peers_or_store()
            code = EXIT_PEER_FAILED
            if message is None:
                # A peer waiting on its own live loader keeps the job moving: this rank may be
                # waiting for it in a collective.
                idle = time.monotonic() - max(self._last_progress, self._peer_waited)
                if idle > self.stall_after:
                    message, code = self._stalled_message(idle), EXIT_STALLED
            if message is not None:
                self._exit(message, code)
                return

    def _exit(self, message: str, code: int) -> None:
        self.exit_message = message
        # On a line of its own: another rank's progress bar or output may end without one.
        print(f"\nrecxla-train: rank {self.rank}: exiting: {message}", file=self.out,
              flush=True)
        self.exit_fn(code)


def _where(value: Optional[bytes]) -> str:
    if value is None:
        return "nowhere (it never sent a heartbeat)"
    return value.decode().split(" ", 3)[3]
