"""How much of the copy and communication streams' work runs under compute kernels, from a
torch.profiler Chrome trace (`recxla.train --kernel-trace`).

The device events of such a trace are complete events ("ph": "X") of category kernel,
gpu_memcpy or gpu_memset, with "ts" and "dur" in microseconds and args.stream. The compute
stream is the stream with the most kernel time (the default stream in recxla's trainer). Every
other stream is a side stream: it holds copies (a stream whose time is mostly gpu_memcpy), NCCL's
kernels (names starting with "nccl"), or other work. For each side stream, and for all of them
together, the busy time is the union of its events' intervals and the overlapped time the part
of it during which the compute stream is busy too; the share is overlapped / busy.
"""

import gzip
import json
from typing import Dict, List, Tuple

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

Interval = Tuple[float, float]


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def union(intervals: List[Interval]) -> List[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    out: List[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals: List[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a: List[Interval], b: List[Interval]) -> float:
    """Total time of two disjoint sorted interval lists' overlap (a linear merge)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            total += end - start
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _kind(events: List[dict]) -> str:
    copy = sum(e["dur"] for e in events if e["cat"] in ("gpu_memcpy", "gpu_memset"))
    if any(e.get("name", "").lower().startswith("nccl") for e in events):
        return "communication"
    if copy * 2 >= sum(e["dur"] for e in events):
        return "copy"
    return "other"


def stream_overlap(trace: dict) -> dict:
    """{"compute_stream", "compute_busy_us", "streams": [{stream, kind, events, busy_us,
    overlapped_us, share}], "side": {busy_us, overlapped_us, share}} of a Chrome trace; with no
    device events (a CPU run) {"compute_stream": None, ...} and empty streams."""
    by_stream: Dict[str, List[dict]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in DEVICE_CATEGORIES or "dur" not in e:
            continue
        args = e.get("args", {})
        stream = f"{args.get('device', 0)}:{args.get('stream', e.get('tid'))}"
        by_stream.setdefault(stream, []).append(e)
    empty = {"busy_us": 0.0, "overlapped_us": 0.0, "share": None}
    if not by_stream:
        return {"compute_stream": None, "compute_busy_us": 0.0, "streams": [], "side": empty}
    kernel_time = {s: sum(e["dur"] for e in ev if e["cat"] == "kernel")
                   for s, ev in by_stream.items()}
    compute = max(kernel_time, key=kernel_time.get)
    spans = {s: union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ev])
             for s, ev in by_stream.items()}
    streams = []
    side_intervals: List[Interval] = []
    for s, ev in sorted(by_stream.items()):
        if s == compute:
            continue
        busy = length(spans[s])
        overlapped = intersection(spans[s], spans[compute])
        side_intervals += spans[s]
        streams.append({"stream": s, "kind": _kind(ev), "events": len(ev),
                        "busy_us": round(busy, 1), "overlapped_us": round(overlapped, 1),
                        "share": round(overlapped / busy, 3) if busy else None})
    side = union(side_intervals)
    busy = length(side)
    overlapped = intersection(side, spans[compute])
    return {"compute_stream": compute, "compute_busy_us": round(length(spans[compute]), 1),
            "streams": streams,
            "side": {"busy_us": round(busy, 1), "overlapped_us": round(overlapped, 1),
                     "share": round(overlapped / busy, 3) if busy else None}}
