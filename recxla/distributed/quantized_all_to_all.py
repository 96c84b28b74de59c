"""Quantized all-to-all: quantize -> one all_to_all_single of wire bytes -> dequantize.

The row codec's output is the wire buffer itself: `quantize_rows` writes every row of x into one
uint8 [N, row_bytes] tensor, rows stay rows, so the caller's row splits are the collective's
splits unchanged and there is no packing copy. The receive buffer is decoded straight into the
output. Backward is the same exchange of the gradient with the splits swapped, in its own format
(bf16 or e5m2 keep the range gradients need).

The rows a rank sends itself never leave the process, so they are not quantized: they are
copied into their place in the output exactly, and the collective carries only the other ranks'
rows (a group of one rank makes no collective at all). Quantizing them would cost the codec's
time and their precision for no byte saved: on 4 ranks a quarter of an evenly spread exchange,
on one rank all of it.

The op is two autograd Functions, as in TorchRec's Req/Wait pair: `_Launch` quantizes and starts
the collective, `_Finish` waits and dequantizes. In backward the order flips: `_Finish.backward`
starts the gradient's exchange and `_Launch.backward` waits for it, so autograd can run other
nodes while the bytes travel. The synchronous call is launch + finish back to back.

Buffers: on CPU, the send buffer, the receive buffer and the decoded output of every exchange
(forward and backward) come from recxla's reusable buffers (recxla.ops.fp8_rows.empty_buffer):
a buffer is reused by a later call that needs the same bytes (same rows, width, format) once
nothing references it any more. The exchange holds its send and receive buffers until its data
has arrived and been decoded, so a buffer of an exchange still in flight (an async handle not yet
waited on, a gradient still travelling) is never handed to another call; the output is the
caller's until the caller lets it go. gloo's worker thread drops its references to a finished
exchange's tensors a moment after wait() returns (milliseconds on a busy machine); a call made in
that moment gets a second set of buffers of that size, once. A training loop with steady shapes
therefore allocates no new large blocks after its first steps (tests/test_quantized_all_to_all.py
counts the page faults). On CUDA the caching allocator does the same.
"""

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from recxla.distributed.split_validation import exchange_splits
from recxla.formats import DEFAULT_BWD_COMM, DEFAULT_FWD_COMM, FLOAT_DTYPES, as_count, get_format
from recxla.ops.fp8_rows import dequantize_rows, empty_buffer, quantize_rows

OP = "recxla.quantized_all_to_all"

Splits = Union[Sequence[int], torch.Tensor]


@dataclass
class _Exchange:
    """Everything one call needs, kept alive until its data has arrived (forward and backward):
    the buffers an in-flight collective reads and writes must not be freed under it."""

    group: Optional[dist.ProcessGroup]
    rank: int
    world: int
    input_splits: List[int]
    output_splits: List[int]
    dim: int
    fwd: str
    bwd: str
    dtype: torch.dtype
    work: Optional[dist.Work] = None
    buffers: List[torch.Tensor] = field(default_factory=list)
    kept: Optional[torch.Tensor] = None

    def start(self, rows: torch.Tensor, fmt: str, send_splits, recv_splits) -> None:
        """Quantizes the rows for the other ranks into one wire buffer and starts the
        collective; the rows this rank sends itself stay as they are (`kept`)."""
        me, lo = self.rank, sum(send_splits[:self.rank])
        hi = lo + send_splits[me]
        self.kept = rows[lo:hi]
        after = rows.shape[0] - hi
        row_bytes = get_format(fmt, OP).row_bytes(self.dim)
        # Slices only where there are rows: each is a call (a launch on a GPU).
        if lo and after:
            send = empty_buffer((lo + after, row_bytes), torch.uint8, rows.device)
            quantize_rows(rows[:lo], fmt, out=send[:lo])
            quantize_rows(rows[hi:], fmt, out=send[lo:])
        else:
            send = quantize_rows(rows[hi:] if lo == 0 else rows[:lo], fmt)
        recv = empty_buffer((sum(recv_splits) - recv_splits[me], row_bytes), torch.uint8,
                            rows.device)
        if self.world > 1:
            wire_send, wire_recv = list(send_splits), list(recv_splits)
            wire_send[me] = wire_recv[me] = 0
            self.work = dist.all_to_all_single(
                recv, send, wire_recv, wire_send, group=self.group, async_op=True
            )
        self.buffers = [send, recv]

    def finish(self, fmt: str, recv_splits) -> torch.Tensor:
        """Waits for the rows and decodes them, with the kept rows in their place (rank
        order)."""
        if self.work is not None:
            self.work.wait()
        recv, kept = self.buffers[1], self.kept
        if kept.shape[0] == 0:
            out = dequantize_rows(recv, self.dim, fmt, self.dtype)
        else:
            lo = sum(recv_splits[:self.rank])
            out = empty_buffer((recv.shape[0] + kept.shape[0], self.dim), self.dtype,
                               recv.device)
            if lo:
                dequantize_rows(recv[:lo], self.dim, fmt, out=out[:lo])
            out[lo:lo + kept.shape[0]].copy_(kept)
            if lo < recv.shape[0]:
                dequantize_rows(recv[lo:] if lo else recv, self.dim, fmt,
                                out=out[lo + kept.shape[0]:])
        # Only now may the send and receive buffers serve another exchange.
        self.work, self.buffers, self.kept = None, [], None
        return out


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, ex: _Exchange) -> torch.Tensor:
        ex.start(x, ex.fwd, ex.input_splits, ex.output_splits)
        ctx.ex = ex
        # An empty tensor that only carries the autograd edge from x to _Finish.
        return x.new_empty(0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _grad_token):
        return ctx.ex.finish(ctx.ex.bwd, ctx.ex.input_splits), None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token: torch.Tensor, ex: _Exchange) -> torch.Tensor:
        ctx.ex = ex
        ctx.token_dtype = token.dtype
        return ex.finish(ex.fwd, ex.output_splits)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        ex = ctx.ex
        ex.start(grad_out, ex.bwd, ex.output_splits, ex.input_splits)
        return grad_out.new_empty(0, dtype=ctx.token_dtype), None


class QuantizedAllToAllHandle:
    """The result of `quantized_all_to_all(..., async_op=True)`.

    The exchange is in flight until `wait()`; the send and receive buffers live on this handle
    until then (as DeepEP's EventOverlap keeps its tensors), so no stream bookkeeping is needed
    and no other call can be handed them. Do not modify x in place before `wait()`: a cast
    format whose wire dtype is x's own (fp32 for float32 rows) sends x's own memory.
    """

    def __init__(self, token: torch.Tensor, ex: _Exchange):
        self._token: Optional[torch.Tensor] = token
        self._ex = ex
        self._output: Optional[torch.Tensor] = None
        rb = get_format(ex.fwd, OP).row_bytes(ex.dim)
        #: Bytes this rank sends to and receives from the other ranks (its rows to itself
        #: never leave the process).
        self.bytes_sent = (sum(ex.input_splits) - ex.input_splits[ex.rank]) * rb
        self.bytes_received = (sum(ex.output_splits) - ex.output_splits[ex.rank]) * rb

    def is_completed(self) -> bool:
        """True when the data has arrived (wait() will not block)."""
        return self._output is not None or self._ex.work is None or self._ex.work.is_completed()

    def wait(self) -> torch.Tensor:
        """Block until the rows have arrived; returns [sum(output_split_sizes), D] in x's dtype,
        differentiable w.r.t. x. Calling it again returns the same tensor."""
        if self._output is None:
            self._output = _Finish.apply(self._token, self._ex)
            self._token = None
        return self._output


def _as_splits(splits: Splits, name: str, world: int) -> List[int]:
    """A list of W Python ints >= 0 from a list/tuple of integers (Python ints, numpy integers,
    0-d integer tensors), a 1-D integer tensor or a 1-D integer numpy array."""
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1 or splits.is_floating_point() or splits.is_complex():
            raise TypeError(f"{OP}: {name} must be a 1-D integer tensor or a list of ints")
        splits = splits.tolist()
    elif type(splits).__module__ == "numpy" and hasattr(splits, "tolist"):
        if getattr(splits, "ndim", 0) != 1 or splits.dtype.kind not in "iu":
            raise TypeError(f"{OP}: {name} must be a 1-D integer array or a list of ints, got "
                            f"{splits.ndim}-D {splits.dtype}")
        splits = splits.tolist()
    if not isinstance(splits, (list, tuple)):
        raise TypeError(f"{OP}: {name} must be a list of ints, got {type(splits).__name__}")
    if len(splits) != world:
        raise ValueError(
            f"{OP}: {name} must have one entry per rank of the group ({world}), got {len(splits)}"
        )
    out = []
    for i, s in enumerate(splits):
        try:
            out.append(as_count(s, OP, f"{name}[{i}]"))
        except TypeError:
            raise TypeError(
                f"{OP}: {name} must hold ints (Python or numpy integers), got {s!r} "
                f"({type(s).__name__}) at index {i}") from None
        except ValueError:
            raise ValueError(f"{OP}: {name} must be >= 0, got {list(splits)}") from None
    return out


def quantized_all_to_all(
    x: torch.Tensor,
    output_split_sizes: Optional[Splits],
    input_split_sizes: Optional[Splits],
    group: Optional[dist.ProcessGroup] = None,
    fwd: str = DEFAULT_FWD_COMM,
    bwd: str = DEFAULT_BWD_COMM,
    async_op: bool = False,
    validate_splits: bool = True,
) -> Union[torch.Tensor, QuantizedAllToAllHandle]:
    """All-to-all of the rows of x, sent quantized, as one differentiable op.

    Rows x[sum(input_split_sizes[:r]) : ...+input_split_sizes[r]] go to rank r; the rows from
    rank r land in the output in rank order, as in `torch.distributed.all_to_all_single`.

    Args:
        x: [N, D] float32, bfloat16 or float16, on CPU (gloo) or CUDA (NCCL); may be strided.
            N may be 0, and any split may be 0.
        output_split_sizes: rows to receive from each rank (W integers, W = group size: a list
            or tuple of Python or numpy integers, a 1-D integer tensor or numpy array), or None:
            derived from the peers' input_split_sizes by the split exchange (below).
        input_split_sizes: rows to send to each rank (W integers summing to N, as above), or
            None for N / W rows each (N must then be a multiple of W).
        group: the process group; None is the default group.
        fwd: wire format of the forward rows: "e4m3", "e5m2" (FP8, one fp32 scale per row,
            D + 4 bytes a row), "bf16", "fp16" (2 D bytes) or "fp32" (4 D bytes, exact).
        bwd: wire format of the gradient rows in backward (same names).
        async_op: False returns the output; True returns a QuantizedAllToAllHandle whose wait()
            returns it, so the caller can compute while the rows travel.
        validate_splits: exchange every rank's [input splits, output splits, D, fwd, bwd] (one
            all_gather of 2W + 3 int64 per rank, blocking, on x's device) so that every rank
            checks the whole send/receive matrix and, when ranks disagree, all of them raise the
            same ValueError before any data moves. Cost: one small collective's latency per call
            (0.3 to 0.7 ms on 2 gloo ranks over loopback on a busy 2-core machine; `python -m
            recxla.demo` prints it); pass False in a hot loop whose splits are known to agree.
            All ranks must pass the same value. Without it recxla cannot see a disagreement,
            and gloo (torch 2.14, tried on 2 ranks) does this: a rank that is sent more rows
            than it expects is aborted by gloo (SIGABRT, "Received data size doesn't match
            expected size"), taking its process down; a rank that is sent fewer rows than it
            expects returns normally with the missing rows uninitialized (silently wrong
            output). A rank whose entries for itself disagree raises ValueError before sending
            (checked always, at no cost). NCCL passes no sizes between ranks either (not tried
            here). With output_split_sizes=None the exchange always runs: it
            is how the sizes are learned.
    Returns:
        [sum(output_split_sizes), D] in x's dtype (or a handle, see async_op). The rows this
        rank sends itself are copied exactly (they never leave the process, so they are not
        quantized); the others went through `fwd`. Its gradient w.r.t. x is the all-to-all of
        the output's gradient back, sent in `bwd` (again exact for this rank's own rows).
    Raises:
        TypeError / ValueError naming the argument, on this rank and before any communication,
        for a bad x, format name or split list, or split sums that do not match N (a peer
        without the error then waits in its collective until the group's timeout, as with any
        collective one rank skips); ValueError on every rank (with validate_splits) when the
        ranks' splits, D or formats disagree.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{OP}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{OP}: x must be 2-D [rows, dim], got {x.dim()}-D shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{OP}: x must be float32, bfloat16 or float16, got {x.dtype}")
    get_format(fwd, OP, "fwd")
    get_format(bwd, OP, "bwd")
    for name, flag in (("async_op", async_op), ("validate_splits", validate_splits)):
        if not isinstance(flag, bool):
            raise TypeError(f"{OP}: {name} must be a bool, got {flag!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{OP}: needs an initialized process group (init_process_group)")
    world = dist.get_world_size(group)
    n = x.shape[0]
    if input_split_sizes is None:
        if n % world:
            raise ValueError(
                f"{OP}: input_split_sizes=None splits x's {n} rows evenly, but {n} is not a "
                f"multiple of the group size {world}"
            )
        input_splits = [n // world] * world
    else:
        input_splits = _as_splits(input_split_sizes, "input_split_sizes", world)
        if sum(input_splits) != n:
            raise ValueError(
                f"{OP}: input_split_sizes sum to {sum(input_splits)}, but x has {n} rows"
            )
    output_splits = None
    if output_split_sizes is not None:
        output_splits = _as_splits(output_split_sizes, "output_split_sizes", world)

    if validate_splits or output_splits is None:
        output_splits = exchange_splits(
            OP, group, x.device, input_splits, output_splits, x.shape[1], fwd, bwd
        )

    rank = dist.get_rank(group)
    if input_splits[rank] != output_splits[rank]:
        raise ValueError(
            f"{OP}: this rank (rank {rank} of the group) sends itself {input_splits[rank]} rows "
            f"(input_split_sizes[{rank}]) but expects {output_splits[rank]} from itself "
            f"(output_split_sizes[{rank}]); the two must be equal")
    ex = _Exchange(group, rank, world, input_splits, output_splits, x.shape[1],
                   fwd, bwd, x.dtype)
    handle = QuantizedAllToAllHandle(_Launch.apply(x, ex), ex)
    return handle if async_op else handle.wait()
