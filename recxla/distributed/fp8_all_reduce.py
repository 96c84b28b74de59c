"""Dense gradients averaged over the ranks in FP8, with error feedback: FP8AllReduce and the DDP
communication hook fp8_compress_hook.

On the wire each value is one e4m3 byte, with one fp32 scale per chunk of `chunk` values (recxla's
row codec, a chunk being a row): 1.03 bytes a value at the default 128, against bf16's 2 and
fp32's 4. What quantizing loses is not dropped but carried to the next step (error feedback,
as in 1-bit SGD, Seide et al. 2014, and EF-SGD, Karimireddy et al. 2019): each rank adds its
residual to what it sends next, so over the steps the sum of what was sent equals the sum of
the gradients up to one step's error, and training converges as with the exact average.

How a set of gradients travels (a reduce-scatter then an all-gather, a ring all-reduce's bytes):
1. Every parameter's gradient, divided by the world size, is cut into chunks of `chunk` values
   (the last one padded with zeros). Chunk j of the parameter with index i (its place among the
   parameters given to FP8AllReduce) belongs to one rank: (i + j) mod G, G the ranks of the
   group. The owner depends on the parameter and the chunk alone, never on how DDP groups
   the parameters into buckets (it regroups them after the first step), so that each residual
   stays with its chunk and a resumed run continues bit for bit.
2. Each rank adds its send residual to its chunks, quantizes them, keeps what quantizing lost
   as its new send residual, and an all_to_all sends every chunk to its owner.
3. The owner sums the G dequantized copies of its chunks in rank order, adds its sum residual,
   quantizes the sum (keeping the loss as its new sum residual) and an all-gather gives every
   rank every owner's codes. Every rank dequantizes the same bytes: the averaged gradients are
   the same bits on every rank, as replicated parameters need.

By node (node_group / cross_group given, e.g. recxla.torchrec.make_topology_2d's shard_group and
replica_group): the ranks of a node first sum their chunks among themselves in fp32 over the
node's fast links (an all_to_all of fp32 chunks, chunk j of parameter i to local rank
(i + j) mod L), then steps 2-3 run across the nodes among the ranks of the same local rank
(owner ((i + j) div L) mod N), and an all-gather inside the node gives every local rank the
sums of the others. Only FP8 crosses the nodes: 1/L of the chunks per rank.

Every call issues its collectives from the calling thread, in program order (never from a
completion callback), so every rank issues them in the same order on each group.
"""

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from recxla.distributed.compressed_all_reduce import CompressedAllReduce
from recxla.distributed.gather import all_gather_flat
from recxla.distributed.traffic import carrying
from recxla.ops.fp8_rows import dequantize_rows, quantize_rows

OP = "recxla.distributed.FP8AllReduce"
DEFAULT_CHUNK = 128
FORMATS = ("e4m3", "e5m2")


def _sum_in_rank_order(copies: torch.Tensor, ranks: int) -> torch.Tensor:
    """The sum of `copies` [ranks * n, chunk], block by block in rank order: the same float
    sum, bit for bit, on every rank that sums the same blocks."""
    count = copies.shape[0] // ranks
    total = copies[:count].clone()
    for s in range(1, ranks):
        total += copies[s * count:(s + 1) * count]
    return total


def _run_starts(runs):
    """Where each of `runs` [(first, rows)] starts when they are laid one after the other."""
    at = 0
    for _, n in runs:
        yield at
        at += n


# An all-gather of uneven blocks (rank r holds counts[r] rows): every block padded to the
# longest, then the padding dropped.
def _padded(rows: torch.Tensor, counts: List[int]) -> torch.Tensor:
    longest = max(counts)
    if rows.shape[0] == longest:
        return rows
    padded = rows.new_zeros((longest, rows.shape[1]))
    padded[:rows.shape[0]] = rows
    return padded


def _unpadded(everyone: torch.Tensor, counts: List[int]) -> torch.Tensor:
    longest = max(counts)
    if min(counts) == longest:
        return everyone
    return torch.cat([everyone[s * longest:s * longest + n] for s, n in enumerate(counts)])


def _all_gather_uneven(rows: torch.Tensor, counts: List[int], group) -> torch.Tensor:
    """Every rank's `rows`, one after the other in rank order (blocking)."""
    padded = _padded(rows, counts)
    everyone = rows.new_empty((len(counts) * padded.shape[0], rows.shape[1]))
    with carrying("dense"):
        all_gather_flat(everyone.view(-1), padded.view(-1), group=group)
    return _unpadded(everyone, counts)


class _Layout:
    """Where the chunks of one set of parameters go. Rows are numbered two ways: in the set
    (the parameters' rows one after the other, `starts`) and globally (`global_rows`: the
    rows of every parameter FP8AllReduce knows, where its residuals live). Each row has an
    owner inside the node (`local`) and across the nodes (`cross`); the orders group them."""

    def __init__(self, indices: Sequence[int], rows: Sequence[int], row_offsets: Sequence[int],
                 local_size: int, cross_size: int, local_rank: int, cross_rank: int, device):
        self.starts = [0]
        for n in rows:
            self.starts.append(self.starts[-1] + n)
        global_rows = torch.cat([torch.arange(n, dtype=torch.int64) + row_offsets[i]
                                 for i, n in zip(indices, rows)])
        position = torch.cat([torch.arange(n, dtype=torch.int64) + i
                              for i, n in zip(indices, rows)])
        local = position % local_size
        cross = (position // local_size) % cross_size
        # Node level: the rows grouped by their local owner; this rank sums those it owns
        # (`mine`, indices into the set's rows).
        self.local_order = torch.argsort(local, stable=True).to(device)
        self.local_counts = torch.bincount(local, minlength=local_size).tolist()
        mine = torch.nonzero(local == local_rank).flatten()
        # Cross level, among this local rank's rows: grouped by their owner across the nodes.
        cross_order = torch.argsort(cross[mine], stable=True)
        self.cross_counts = torch.bincount(cross[mine], minlength=cross_size).tolist()
        self.cross_order = cross_order.to(device)
        # The global rows of this local rank's rows in cross order (their send residuals), and
        # of those this rank owns across the nodes (their sum residuals).
        sent = global_rows[mine[cross_order]]
        first = sum(self.cross_counts[:cross_rank])
        self.sent_rows = sent.to(device)
        # One rank per node: the set's rows are this rank's, in parameter order, so their send
        # residuals are runs of the global rows: (first global row, rows) per parameter.
        self.param_runs = [(row_offsets[i], n) for i, n in zip(indices, rows)] \
            if local_size == 1 else None
        self.owned_rows = sent[first:first + self.cross_counts[cross_rank]].to(device)


class FP8AllReduceHandle:
    """One set of gradients on its way: `gather()` (every rank, in the order of the starts)
    sums the chunks this rank owns and starts the all-gather; `wait()` completes it and writes
    the averages into the gradients."""

    def __init__(self, owner: "FP8AllReduce", grads: List[torch.Tensor], layout: _Layout,
                 received: torch.Tensor, work):
        self._owner, self._grads, self._layout = owner, grads, layout
        self._received, self._work = received, work
        self._gathered = None
        self._done = False

    def gather(self) -> None:
        if self._gathered is not None or self._done:
            return
        owner, layout = self._owner, self._layout
        if self._work is not None:
            self._work.wait()
        copies = dequantize_rows(self._received, owner.chunk, owner.fmt, torch.float32)
        codes = owner.quantize_with_feedback(_sum_in_rank_order(copies, owner.cross_size),
                                             "sum", layout.owned_rows)
        self._work = None
        if owner.cross_size == 1:
            self._gathered = codes
            return
        # Asynchronous, unlike _all_gather_uneven: every handle's all-gather travels together.
        padded = _padded(codes, layout.cross_counts)
        self._gathered = codes.new_empty((owner.cross_size * padded.shape[0], codes.shape[1]))
        with carrying("dense"):
            self._work = all_gather_flat(self._gathered.view(-1), padded.view(-1),
                                         group=owner.cross_group, async_op=True)

    def wait(self) -> None:
        if self._done:
            return
        self.gather()
        owner, layout = self._owner, self._layout
        if self._work is not None:
            self._work.wait()
        gathered = self._gathered if owner.cross_size == 1 else \
            _unpadded(self._gathered, layout.cross_counts)
        # Back to this local rank's row order while they are codes (a quarter of fp32's bytes).
        local_codes = torch.empty_like(gathered).index_copy_(0, layout.cross_order, gathered)
        local_rows = dequantize_rows(local_codes, owner.chunk, owner.fmt, torch.float32)
        rows = local_rows
        if owner.local_size > 1:
            grouped = _all_gather_uneven(local_rows, layout.local_counts, owner.node_group)
            rows = torch.empty_like(grouped).index_copy_(0, layout.local_order, grouped)
        for g, start, end in zip(self._grads, layout.starts, layout.starts[1:]):
            flat = g.view(-1)
            flat.copy_(rows[start:end].view(-1)[:flat.numel()])
        self._done = True


class FP8AllReduce(CompressedAllReduce):
    """Averages gradients over the ranks in FP8 with error feedback (module docstring); holds
    the residuals, which `state_dict()` / `load_state_dict()` save and restore by parameter
    name.

    Args:
        named_parameters, group, node_group, cross_group: as CompressedAllReduce's.
        fmt: "e4m3" (default) or "e5m2".
        chunk: values per scale (default 128).
        error_feedback: carry what quantizing lost to the next call (default True).
    """

    op = OP
    state_name = "fp8"  # recxla.train.checkpoint files its state_dict under this name

    def __init__(self, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
                 group: Optional[dist.ProcessGroup] = None,
                 node_group: Optional[dist.ProcessGroup] = None,
                 cross_group: Optional[dist.ProcessGroup] = None, fmt: str = "e4m3",
                 chunk: int = DEFAULT_CHUNK, error_feedback: bool = True):
        if fmt not in FORMATS:
            raise ValueError(f"{OP}: fmt must be one of {FORMATS}, got {fmt!r}")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"{OP}: chunk must be an int >= 1, got {chunk!r}")
        super().__init__(named_parameters, group, node_group, cross_group)
        self.fmt, self.chunk = fmt, chunk
        self.error_feedback = bool(error_feedback)
        # Per parameter index: its chunks' rows and where they start among all rows.
        self.rows = [max(1, math.ceil(p.numel() / chunk)) for p in self.parameters]
        self.row_offsets = [sum(self.rows[:i]) for i in range(len(self.rows))]
        # "sent" / "sum" -> residual rows [every parameter's rows, chunk], made on first use;
        # zeros in the rows whose residual lives on another rank.
        self._residuals: Dict[str, Optional[torch.Tensor]] = {"sent": None, "sum": None}
        self._layouts: Dict[Tuple, _Layout] = {}

    # -- residuals ----------------------------------------------------------------------------
    def residuals(self, which: str) -> torch.Tensor:
        """The "sent" or "sum" residual rows of every parameter, [sum(rows), chunk] float32."""
        if self._residuals[which] is None:
            self._residuals[which] = torch.zeros((sum(self.rows), self.chunk),
                                                 dtype=torch.float32, device=self.device)
        return self._residuals[which]

    def quantize_with_feedback(self, values: torch.Tensor, which: str, rows) -> torch.Tensor:
        """The codes of `values` (a fresh tensor, consumed) plus the `which` residuals of the
        global `rows` (an index tensor, or runs [(first row, rows)] in values' order: slices,
        no gather); what quantizing loses becomes those rows' residuals."""
        if not self.error_feedback:
            return quantize_rows(values, self.fmt)
        residuals = self.residuals(which)
        if isinstance(rows, torch.Tensor):
            values += residuals.index_select(0, rows)
        else:
            for at, (first, n) in zip(_run_starts(rows), rows):
                values[at:at + n] += residuals[first:first + n]
        codes = quantize_rows(values, self.fmt)
        values.sub_(dequantize_rows(codes, self.chunk, self.fmt, torch.float32))
        if isinstance(rows, torch.Tensor):
            residuals.index_copy_(0, rows, values)
        else:
            for at, (first, n) in zip(_run_starts(rows), rows):
                residuals[first:first + n].copy_(values[at:at + n])
        return codes

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """{"<parameter>.sent_residual" / ".sum_residual": rows [ceil(numel / chunk), chunk]
        float32} of this rank (each rank's differ), every parameter's (zeros before its
        first average): what a resumed run needs to continue bit for bit. The tensors are
        views of the live residuals: loading into them in place (as
        torch.distributed.checkpoint does) restores them."""
        return {f"{name}.{which}_residual": self.residuals(which).narrow(0, offset, rows)
                for which in self._residuals
                for name, offset, rows in zip(self.names, self.row_offsets, self.rows)}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        """Restores the residuals of `state` (a state_dict()); those it lacks start at zero."""
        by_name = {n: i for i, n in enumerate(self.names)}
        loaded = []
        for key, value in state.items():
            name, _, suffix = key.rpartition(".")
            which = suffix.removesuffix("_residual")
            if name not in by_name or suffix != f"{which}_residual" or \
                    which not in self._residuals:
                raise ValueError(f"{OP}: load_state_dict: {key!r} is no residual of these "
                                 "parameters")
            i = by_name[name]
            if not isinstance(value, torch.Tensor) or \
                    tuple(value.shape) != (self.rows[i], self.chunk):
                raise ValueError(f"{OP}: load_state_dict: {key!r} must be rows "
                                 f"[{self.rows[i]}, {self.chunk}], got "
                                 f"{getattr(value, 'shape', value)!r}")
            loaded.append((which, i, value.detach().to(self.device, torch.float32).clone()))
        for which in self._residuals:
            self.residuals(which).zero_()
        for which, i, value in loaded:
            self.residuals(which).narrow(0, self.row_offsets[i], self.rows[i]).copy_(value)

    # -- the collectives ----------------------------------------------------------------------
    def start(self, params: Sequence[torch.Tensor],
              grads: Sequence[torch.Tensor]) -> FP8AllReduceHandle:
        """Starts averaging `grads` (the gradients of `params`, contiguous, written in place
        at wait()). Every rank calls it with the same parameters in the same order."""
        indices = self.indices_of(params)
        grads = list(grads)
        if not indices or len(grads) != len(indices):
            raise ValueError(f"{OP}: start needs one gradient per parameter, at least one; got "
                             f"{len(indices)} parameters and {len(grads)} gradients")
        key = tuple(indices)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _Layout(
                indices, [self.rows[i] for i in indices], self.row_offsets, self.local_size,
                self.cross_size, self.local_rank, self.cross_rank, self.device)
        rows = torch.empty((layout.starts[-1], self.chunk), dtype=torch.float32,
                           device=self.device)
        for g, start, end in zip(grads, layout.starts, layout.starts[1:]):
            flat = rows[start:end].view(-1)
            flat[:g.numel()].copy_(g.reshape(-1))
            flat[g.numel():].zero_()  # the last chunk's padding
        rows.div_(self.world)
        if self.local_size > 1:  # the node's sum of the rows this local rank owns, in fp32
            count = layout.local_counts[self.local_rank]
            copies = rows.new_empty((count * self.local_size, self.chunk))
            with carrying("dense"):
                dist.all_to_all_single(copies, rows.index_select(0, layout.local_order),
                                       [count] * self.local_size, layout.local_counts,
                                       group=self.node_group)
            rows = _sum_in_rank_order(copies, self.local_size)
            codes = self.quantize_with_feedback(rows.index_select(0, layout.cross_order), "sent",
                                                layout.sent_rows)
        else:  # quantized in parameter order, the codes (not the floats) put in owner order
            codes = self.quantize_with_feedback(rows, "sent", layout.param_runs)
            codes = codes.index_select(0, layout.cross_order)
        count = layout.cross_counts[self.cross_rank]
        work = None
        received = codes
        if self.cross_size > 1:
            received = codes.new_empty((count * self.cross_size, codes.shape[1]))
            with carrying("dense"):
                work = dist.all_to_all_single(received, codes, [count] * self.cross_size,
                                              layout.cross_counts, group=self.cross_group,
                                              async_op=True)
        return FP8AllReduceHandle(self, grads, layout, received, work)


def fp8_compress_hook(state: FP8AllReduce, bucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that averages the gradients in FP8 with error feedback:

        ddp.register_comm_hook(FP8AllReduce.for_ddp(ddp), fp8_compress_hook)

    (`for_ddp(ddp, node_group=..., cross_group=...)` by node). Each bucket's all_to_all starts
    as DDP hands it over, while the rest of the backward runs; the last bucket's call completes
    them all, from the backward's thread. Save `state.state_dict()` with the model's to resume
    bit for bit."""
    return state.hook(bucket)
