"""A timeline of what the pipeline did, as a Chrome trace (chrome://tracing, Perfetto).

The pipeline records its compute and its waits as spans (`span("dense", micro_batch=k)`);
collectives come from the trainer's CommMeter records (issued .. done, one row per kind of
collective, so overlapping all-to-alls stay readable). Times are `time.perf_counter()` seconds.
"""

import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional


@dataclass
class Span:
    name: str
    start: float
    end: float
    args: Dict[str, Any] = field(default_factory=dict)


class Timeline:
    """Spans of one rank. Disabled timelines record nothing and cost one attribute check."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.spans: List[Span] = []

    @contextlib.contextmanager
    def span(self, name: str, **args) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append(Span(name, start, time.perf_counter(), args))

    def chrome_trace(self, rank: int = 0, collectives: Optional[Iterable[Any]] = None,
                     origin: Optional[float] = None) -> Dict[str, Any]:
        """-> a Chrome trace dict: pid = rank, thread 0 = the caller's compute and waits,
        threads 1.. = collectives by op (records with op, phase, issued, done, bytes_sent)."""
        collectives = list(collectives or [])
        times = [s.start for s in self.spans] + [c.issued for c in collectives]
        origin = min(times) if origin is None and times else (origin or 0.0)
        events = [{"name": "process_name", "ph": "M", "pid": rank,
                   "args": {"name": f"rank {rank}"}},
                  {"name": "thread_name", "ph": "M", "pid": rank, "tid": 0,
                   "args": {"name": "compute and waits"}}]
        for s in self.spans:
            events.append({"name": s.name, "ph": "X", "pid": rank, "tid": 0,
                           "ts": (s.start - origin) * 1e6, "dur": (s.end - s.start) * 1e6,
                           "args": s.args})
        threads: Dict[str, int] = {}
        for c in collectives:
            if c.done is None:
                continue
            tid = threads.setdefault(c.op, len(threads) + 1)
            events.append({"name": f"{c.op} ({c.phase})", "ph": "X", "pid": rank, "tid": tid,
                           "ts": (c.issued - origin) * 1e6, "dur": (c.done - c.issued) * 1e6,
                           "args": {"bytes_sent": c.bytes_sent}})
        for op, tid in threads.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                           "args": {"name": op}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, traces: List[Dict[str, Any]]) -> None:
    """Writes the traces of several ranks as one file."""
    events = [e for t in traces for e in t["traceEvents"]]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
