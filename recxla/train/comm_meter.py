"""CommMeter: bytes and time of every torch.distributed collective, for any training path.

The trainer measures TorchRec's path and recxla's path with this one instrument, so that their
figures compare on equal terms. While installed, it replaces the collectives of
`torch.distributed` (all_to_all_single, all_to_all, all_reduce, all_gather, all_gather_single,
reduce_scatter, reduce_scatter_single, their deprecated names all_gather_into_tensor and
reduce_scatter_tensor, broadcast, barrier) with wrappers
that record, per call:

- bytes sent to and received from other ranks (a rank's own split never leaves the process),
  and the part of them sent to ranks on other nodes (those cross the network links);
- the time the collective was in flight: from its call to its completion (async calls complete
  in gloo's threads: `work.get_future()` callbacks stamp the time);
- the time the caller was blocked waiting for it: a synchronous call's whole duration, or the
  time spent in `Work.wait()` of an async one (the Work handed back is a `dist.Work` subclass, so
  TorchRec's `isinstance(req, dist.Work)` checks still hold). Blocked time is communication not
  hidden behind compute: the exposed communication.
Each call is tagged with the phase the caller set (`with meter.phase("backward"): ...`) and the
step it belongs to (`begin_step` / `end_step`). Blocked time counts in the step in which it
was spent; bytes and time in flight in the step that issued the call.

Byte counts follow the data each algorithm moves: all-to-alls exactly (per destination, from
the splits); all-reduce as a ring (2 (W-1)/W of the buffer to the next rank), all-gather and
reduce-scatter as rings ((W-1) chunks to the next rank), broadcast as the root sending to each
peer. gloo's choice of algorithm can differ: the emulated-cluster benchmark checks these counts
against the link's own byte counters.

Not seen: collectives issued from C++ (DDP's built-in all-reduce: register
`torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook`, which goes through
`dist.all_reduce`, and report its wait with `add_blocked`) and functional collectives
(`torch.ops._c10d_functional`, used under torch.compile).
"""

import contextlib
import inspect
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from recxla.distributed import traffic

METERED = (
    "all_to_all_single", "all_to_all", "all_reduce", "all_gather", "all_gather_single",
    "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
    "broadcast", "barrier",
)  # fmt: skip
NO_STEP = -1
_ALL_TO_ALL = ("all_to_all_single", "all_to_all")
_ALL_GATHER_SINGLE = ("all_gather_single", "all_gather_into_tensor")
_REDUCE_SCATTER = ("reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor")
_REDUCTIONS = ("all_reduce", *_ALL_GATHER_SINGLE, *_REDUCE_SCATTER)


@dataclass
class CollectiveRecord:
    """One collective call. Times are `clock()` seconds; `done` is None until it completes."""

    op: str
    phase: str
    kind: str
    step: int
    bytes_sent: int
    bytes_received: int
    cross_node_bytes_sent: int
    issued: float
    done: Optional[float] = None


@dataclass
class StepComm:
    """Communication of one step (a rank's view).

    bytes_sent: {"<phase>/<kind>": bytes sent to other ranks}; cross_node_bytes_sent: the part
    sent to ranks on other nodes; comm_s: time at least one of the step's collectives was in
    flight (overlapping calls count once); exposed_s: time the caller was blocked on
    communication during the step, and exposed_by_phase its split by phase; calls: collectives
    issued.
    """

    step: int
    bytes_sent: Dict[str, int] = field(default_factory=dict)
    bytes_received: int = 0
    cross_node_bytes_sent: int = 0
    comm_s: float = 0.0
    exposed_s: float = 0.0
    exposed_by_phase: Dict[str, float] = field(default_factory=dict)
    calls: int = 0

    @property
    def total_bytes_sent(self) -> int:
        return sum(self.bytes_sent.values())


def kind_of(op: str, phase: str, tensor: Optional[torch.Tensor]) -> str:
    """What a collective carries: "ids" (the input dist's phase, or integer tensors: ids,
    lengths, splits; recxla packs its ids as uint8), "embeddings" (float or packed uint8 rows
    through an all-to-all: with the phase, the pooled embeddings forward or their gradients
    backward), "dense" (all-reduce of float tensors, and the reduce-scatters and all-gathers
    of all_reduce_by_node: the data-parallel gradients; and whatever recxla.distributed.traffic
    tags: the all_to_alls of FP8AllReduce), else the op's name."""
    tagged = traffic.carried()
    if tagged is not None:
        return tagged
    if phase == "input":
        return "ids"
    if tensor is not None and not tensor.is_floating_point() and tensor.dtype != torch.uint8:
        return "ids"
    if op in _ALL_TO_ALL:
        return "embeddings"
    if op in _REDUCTIONS:
        return "dense"
    return op


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _split_bytes(t: torch.Tensor, splits, world: int) -> List[int]:
    """Bytes of each of `world` splits of `t` along dim 0 (even splits when `splits` is None)."""
    rows = t.shape[0] if t.dim() else t.numel()
    row = _nbytes(t) // rows if rows else 0
    if splits is None or len(splits) == 0:
        return [rows // world * row] * world
    return [int(s) * row for s in splits]


class _MeteredWork(dist.Work):
    """The Work of an async collective, timing the caller's wait()."""

    def __init__(self, work: dist.Work, meter: "CommMeter"):
        super().__init__()
        self._work, self._meter = work, meter

    def wait(self, timeout=None):
        start = self._meter.clock()
        try:
            return self._work.wait() if timeout is None else self._work.wait(timeout)
        finally:
            # Counted in the phase and step of the wait: that is where the caller stood still.
            self._meter.add_blocked(self._meter.clock() - start)

    def is_completed(self):
        return self._work.is_completed()

    def is_success(self):
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def get_future(self):
        return self._work.get_future()

    def result(self):
        return self._work.result()

    def synchronize(self):
        return self._work.synchronize()

    def source_rank(self):
        return self._work.source_rank()


class CommMeter:
    """Records the collectives of this process while installed (see the module docstring).

    Args:
        ranks_per_node: ranks per node, to count the bytes that cross nodes (ranks are placed
            node-major, as torchrun does); None: every peer is on another node.
        clock: seconds, monotonic (time.perf_counter).
    Use: `with meter.installed(): ...`, `with meter.phase("forward"): ...`,
    `meter.begin_step(i)` ... `meter.end_step()`, then `meter.step_comm(i)` once the step's
    collectives have completed (async ones complete in the background).
    """

    def __init__(self, ranks_per_node: Optional[int] = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.ranks_per_node = ranks_per_node
        self.clock = clock
        self.records: List[CollectiveRecord] = []
        self.blocked: Dict[int, Dict[str, float]] = {}
        self.step = NO_STEP
        self._phase = "other"
        self._originals: Dict[str, Callable] = {}
        self._local = threading.local()
        self._signatures: Dict[str, inspect.Signature] = {}

    # -- installing ---------------------------------------------------------------------------
    def install(self) -> None:
        if self._originals:
            return
        for name in METERED:
            # A collective this torch lacks (all_gather_single is newer than some releases
            # recxla runs on) cannot be called, so it needs no meter.
            original = getattr(c10d, name, None)
            if original is None:
                continue
            self._originals[name] = original
            self._signatures[name] = inspect.signature(original)
            wrapper = self._wrap(name, original)
            # TorchRec and recxla call `dist.<name>`, torch's own helpers `c10d.<name>`: both.
            setattr(c10d, name, wrapper)
            setattr(dist, name, wrapper)

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
        self._originals.clear()

    @contextlib.contextmanager
    def installed(self) -> Iterator["CommMeter"]:
        self.install()
        try:
            yield self
        finally:
            self.uninstall()

    # -- phases and steps ---------------------------------------------------------------------
    @property
    def current_phase(self) -> str:
        return self._phase

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Tag the collectives issued inside the block with phase `name`."""
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    def begin_step(self, index: int) -> None:
        self.step = index

    def end_step(self) -> None:
        self.step = NO_STEP

    def add_blocked(self, seconds: float, phase: Optional[str] = None) -> None:
        """Count `seconds` of the caller blocked on communication in the current step, in
        `phase` (None: the current phase)."""
        per_phase = self.blocked.setdefault(self.step, {})
        phase = self._phase if phase is None else phase
        per_phase[phase] = per_phase.get(phase, 0.0) + max(seconds, 0.0)

    # -- results ------------------------------------------------------------------------------
    def step_comm(self, step: int) -> StepComm:
        """The StepComm of step `step` (call once its collectives have completed)."""
        by_phase = dict(self.blocked.get(step, {}))
        out = StepComm(step=step, exposed_s=sum(by_phase.values()), exposed_by_phase=by_phase)
        intervals = []
        for r in self.records:
            if r.step != step:
                continue
            key = f"{r.phase}/{r.kind}"
            out.bytes_sent[key] = out.bytes_sent.get(key, 0) + r.bytes_sent
            out.bytes_received += r.bytes_received
            out.cross_node_bytes_sent += r.cross_node_bytes_sent
            out.calls += 1
            intervals.append((r.issued, r.done if r.done is not None else r.issued))
        out.comm_s = _union_length(intervals)
        return out

    # -- the wrappers -------------------------------------------------------------------------
    def _wrap(self, name: str, original: Callable) -> Callable:
        meter = self

        def metered(*args, **kwargs):
            if getattr(meter._local, "depth", 0):  # a collective built on another: count once
                return original(*args, **kwargs)
            meter._local.depth = 1
            try:
                return meter._call(name, original, args, kwargs)
            finally:
                meter._local.depth = 0

        metered.__name__ = metered.__qualname__ = name
        metered.__doc__ = original.__doc__
        metered.__wrapped__ = original
        return metered

    def _call(self, name: str, original: Callable, args, kwargs):
        bound = self._signatures[name].bind(*args, **kwargs)
        arguments = bound.arguments
        group = arguments.get("group")
        phase = self._phase
        record = self._record(name, arguments, group, phase)
        record.issued = self.clock()
        result = original(*args, **kwargs)
        self.records.append(record)
        if not arguments.get("async_op", False) or result is None:
            record.done = self.clock()
            self.add_blocked(record.done - record.issued, phase)
            return result
        try:
            result.get_future().add_done_callback(lambda _: setattr(record, "done", self.clock()))
        except RuntimeError:  # a backend without futures: completion is seen at wait()
            pass
        return _MeteredWork(result, self)

    def _record(self, name: str, a: dict, group, phase: str) -> CollectiveRecord:
        if group is not None and group is not dist.GroupMember.WORLD and \
                not isinstance(group, dist.ProcessGroup):
            group = None
        world = dist.get_world_size(group)
        me = dist.get_rank(group)
        sent, received = [0] * world, 0
        tensor = None
        if name == "all_to_all_single":
            tensor = a["input"]
            sent = _split_bytes(a["input"], a.get("input_split_sizes"), world)
            recv = _split_bytes(a["output"], a.get("output_split_sizes"), world)
            sent[me] = 0
            received = sum(recv) - recv[me]
        elif name == "all_to_all":
            inputs, outputs = a["input_tensor_list"], a["output_tensor_list"]
            tensor = inputs[0] if inputs else None
            sent = [_nbytes(t) for t in inputs]
            sent[me] = 0
            received = sum(_nbytes(t) for i, t in enumerate(outputs) if i != me)
        elif world > 1:
            ring_next = (me + 1) % world
            if name == "all_reduce":
                tensor = a["tensor"]
                sent[ring_next] = 2 * (world - 1) * _nbytes(tensor) // world
                received = sent[ring_next]
            elif name in ("all_gather", *_ALL_GATHER_SINGLE):
                tensor = a["tensor"] if name == "all_gather" else a["input_tensor"]
                sent[ring_next] = (world - 1) * _nbytes(tensor)
                received = sent[ring_next]
            elif name in _REDUCE_SCATTER:
                tensor = a["output"]
                sent[ring_next] = (world - 1) * _nbytes(tensor)
                received = sent[ring_next]
            elif name == "broadcast":
                tensor = a["tensor"]
                root = dist.get_group_rank(group or dist.GroupMember.WORLD, a["src"]) \
                    if a.get("src") is not None else a.get("group_src", 0)
                if me == root:
                    sent = [_nbytes(tensor)] * world
                    sent[me] = 0
                else:
                    received = _nbytes(tensor)
        cross = 0
        if world > 1:
            to_global = (lambda i: i) if group in (None, dist.GroupMember.WORLD) else (
                lambda i: dist.get_global_rank(group, i))
            my_node = self._node(dist.get_rank())
            cross = sum(b for i, b in enumerate(sent) if b and self._node(to_global(i)) != my_node)
        return CollectiveRecord(
            op=name, phase=phase, kind=kind_of(name, phase, tensor), step=self.step,
            bytes_sent=sum(sent), bytes_received=received, cross_node_bytes_sent=cross,
            issued=0.0,
        )

    def _node(self, rank: int) -> int:
        return rank if not self.ranks_per_node else rank // self.ranks_per_node


def _union_length(intervals) -> float:
    """Total length covered by a list of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
