"""Dense gradients averaged over the ranks as low-rank factors, with error feedback (PowerSGD,
Vogels et al. 2019): PowerSGDAllReduce and the DDP communication hook powersgd_compress_hook.

A gradient matrix M [n, m] (a parameter of two dims or more, viewed as [shape[0], the rest])
travels as two thin factors, P = M Q [n, r] and Q = M^T P [m, r], r the rank: n + m values
a column where M has n m. The default DLRM's dense gradients are 0.5M values; at rank 1
their factors and its vectors are about 5,200 fp32 values, 21 KB against bf16's 1.0 MB.
What the factors miss is not dropped but carried to the next step (error feedback): each rank
adds its residual to its next gradient, so over the steps the average of what was applied
follows the average of the gradients, and training converges as with the exact average (the
paper's results; on recxla's DLRM, bench/results/training.md).

How one set of gradients travels (two all-reduces, sums over the ranks, in fp32):
1. Every rank adds its residual to each matrix it compresses: M_w = g_w + e_w. Each P_w =
   M_w Q (Q the previous step's, the same on every rank, its columns orthonormalized) and the
   gradients that travel whole go in one all-reduce: the vectors (biases), the matrices too
   small for the factors to save half their bytes, and every parameter in its first
   `start_step` averages (the model moves fastest then; torch's hook waits the same way).
2. P = sum_w P_w with its columns orthonormalized (Gram-Schmidt), the same bits on every rank;
   each rank's Q_w = M_w^T P goes in the second all-reduce, and Q = their mean.
3. The average is P Q^T = P P^T mean_w(M_w): the mean projected on P's columns. Each rank's
   residual becomes e_w = M_w - P Q^T, so the mean residual is what the mean lost. Q stays for
   the next step (warm start: a power iteration a step keeps P on the gradients' leading
   directions).

Every value is summed at the same place of the same buffer whatever DDP's buckets: a set's
buffer holds its parameters in the order they were given to PowerSGDAllReduce, and the hook
sends one set per backward, every bucket's parameters together (DDP regroups its buckets after
the first step, and a resumed run starts from the first grouping again). So the average is the
same bits on every rank, and a run resumed from `state_dict()` continues bit for bit.

By node (node_group / cross_group given, e.g. recxla.torchrec.make_topology_2d's shard_group and
replica_group), each all-reduce is recxla.distributed.all_reduce_by_node: summed inside the node
first, 1/L of it per rank across the nodes.

Every call issues its collectives from the calling thread, in program order (never from a
completion callback), so every rank issues them in the same order on each group.
"""

from itertools import accumulate
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from recxla.data import hashing
from recxla.distributed.all_reduce_by_node import all_reduce_by_node
from recxla.distributed.compressed_all_reduce import CompressedAllReduce
from recxla.distributed.traffic import carrying
from recxla.ops.copy_runs import Run, copy_runs, pack

OP = "recxla.distributed.PowerSGDAllReduce"
# Averages before a parameter is compressed. torch's hook defaults to 1,000 for long runs and
# its docs suggest about 10% of a run's steps; recxla's trainer and benchmarks run 30 to a few
# hundred steps a run, and the AUC measured with 10 matches bf16's (bench/results/training.md).
DEFAULT_START_STEP = 10
# A matrix is compressed only where its factors take at most half its values (torch's rule).
MIN_COMPRESSION = 2
_TAG_Q = 0x51  # the seed stream of the factors' first Q (recxla.data.hashing.mix_scalar)


# A column whose norm is below float32's smallest normal number is divided by that number
# instead: zero (the only such column in practice) stays zero, without a comparison and a select
# per matrix.
_TINY_NORM = torch.finfo(torch.float32).tiny


def orthonormalize_columns(matrices: Sequence[torch.Tensor]) -> None:
    """Gram-Schmidt on the columns of each of `matrices` ([n_i, r_i]), in place: each column
    minus its projections on the ones before, divided by its norm (a zero column stays zero).
    The k-th columns of every matrix are normalized together (one norm call and one division
    call for all of them: a step's factors are a dozen small matrices, and their per-matrix
    calls were most of PowerSGD's cost); each matrix's result does not depend on the others
    in the list. No host synchronization on a GPU."""
    width = max((m.shape[1] for m in matrices), default=0)
    for k in range(width):
        having = [m for m in matrices if m.shape[1] > k]
        columns = having if width == 1 else [m[:, k] for m in having]
        for matrix, column in zip(having, columns):
            for j in range(k):
                column.sub_(torch.dot(matrix[:, j], column) * matrix[:, j])
        norms = torch._foreach_norm(columns)
        torch._foreach_clamp_min_(norms, _TINY_NORM)
        torch._foreach_div_(columns, norms)


def _matrix_shape(p: torch.Tensor) -> Tuple[int, int]:
    return p.shape[0], p.numel() // max(p.shape[0], 1)


class PowerSGDAllReduceHandle:
    """One set of gradients on its way: `gather()` (every rank, in the order of the starts)
    completes the first all-reduce and starts the second; `wait()` completes it and writes the
    averages into the gradients.

    Args (from PowerSGDAllReduce.start): indices of the set's parameters, in parameter order;
    whole: the gradients that travel whole, as a _WholeGradients; compressed: (parameter
    index, M_w [n, m], the gradient viewed [n, m]) of each compressed gradient; factors: their
    P [n, r], views of `buffer`; buffer: float32, the whole gradients then the factors, being
    summed by `work`."""

    def __init__(self, owner: "PowerSGDAllReduce", indices: List[int],
                 whole: "_WholeGradients",
                 compressed: List[Tuple[int, torch.Tensor, torch.Tensor]],
                 factors: List[torch.Tensor], buffer: torch.Tensor, work):
        self._owner, self._indices = owner, indices
        self._whole, self._compressed, self._factors = whole, compressed, factors
        self._buffer, self._work = buffer, work
        self._q_sum: Optional[torch.Tensor] = None
        self._q_parts: List[torch.Tensor] = []  # each compressed gradient's Q, views of _q_sum
        self._done = False

    def gather(self) -> None:
        if self._q_sum is not None or self._done:
            return
        owner = self._owner
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._whole.numel:
            self._whole.write(self._buffer[:self._whole.numel].div_(owner.world))
        if not self._compressed:
            self._q_sum = self._buffer.new_empty(0)
            return
        orthonormalize_columns(self._factors)
        shapes = [owner.q[i].shape for i, _, _ in self._compressed]
        self._q_sum = self._buffer.new_empty(sum(m * r for m, r in shapes))
        starts = accumulate((m * r for m, r in shapes), initial=0)
        self._q_parts = [self._q_sum.as_strided((m, r), (r, 1), at)
                         for (m, r), at in zip(shapes, starts)]
        for (_, matrix, _), p, q in zip(self._compressed, self._factors, self._q_parts):
            torch.mm(matrix.t(), p, out=q)
        self._work = owner.sum_async(self._q_sum)

    def wait(self) -> None:
        if self._done:
            return
        self.gather()
        owner = self._owner
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._q_sum.div_(owner.world)
        for (i, matrix, grad), p, q in zip(self._compressed, self._factors, self._q_parts):
            if grad.dtype == torch.float32:
                average = torch.mm(p, q.t(), out=grad)
            else:
                average = p @ q.t()
                grad.copy_(average)
            if owner.error_feedback:
                torch.sub(matrix, average, out=owner.residual_matrices[i])
        if self._compressed:
            torch._foreach_copy_([owner.q[i] for i, _, _ in self._compressed], self._q_parts)
        if len(self._indices) == len(owner.names):
            owner.averages.add_(1)
        else:
            owner.averages.index_add_(0, torch.tensor(self._indices),
                                      torch.ones(len(self._indices), dtype=torch.int64))
        self._done = True


class _WholeGradients:
    """The gradients of a set that travel whole, read from where they lie and written back
    there: pieces of flat, contiguous sources (a DDP bucket's buffer, or a gradient of its
    own). In float32, one copy_runs each way (the first `numel` values of the set's buffer, in
    parameter order); otherwise a cast and a cat, and a copy per gradient back.

    Args: sources: the contiguous tensors holding the gradients; pieces: per whole gradient
    in parameter order, (source, element offset, numel)."""

    def __init__(self, sources: List[torch.Tensor], pieces: List[Tuple[int, int, int]]):
        self.sources, self.pieces = sources, pieces
        self.numel = sum(n for _, _, n in pieces)
        self._float32 = all(s.dtype == torch.float32 for s in sources)
        at, self._runs = 0, []
        for source, offset, n in pieces:
            self._runs.append(Run(source, offset, 0, 0, at, 0, 1, n))
            at += n

    def _views(self) -> List[torch.Tensor]:
        return [self.sources[s].view(-1)[offset: offset + n] for s, offset, n in self.pieces]

    def read(self, into: torch.Tensor) -> None:
        """The gradients, in parameter order, into `into` (float32 [numel])."""
        if self._float32:
            copy_runs(self.sources, [into], pack(self._runs))
        else:
            torch.cat([v.float() for v in self._views()], out=into)

    def write(self, averages: torch.Tensor) -> None:
        """`averages` (float32 [numel], read's order) into the gradients."""
        if self._float32:
            copy_runs([averages], self.sources, pack(r.transposed() for r in self._runs))
        else:
            torch._foreach_copy_(self._views(), list(torch.split(
                averages, [n for _, _, n in self.pieces])))


class PowerSGDAllReduce(CompressedAllReduce):
    """Averages gradients over the ranks as rank-`rank` factors with error feedback (module
    docstring); holds the residuals, the factors Q and each parameter's count of averages,
    which `state_dict()` / `load_state_dict()` save and restore by parameter name.

    Args:
        named_parameters, group, node_group, cross_group: as CompressedAllReduce's.
        rank: the factors' columns (default 1, the most compression; a matrix of fewer rows or
            columns gets that many).
        start_step: averages of a parameter sent whole before it is compressed (default 10).
        error_feedback: carry what the factors miss to the next call (default True).
        seed: the first Q's random draw, the same on every rank (default 0).
    """

    op = OP
    state_name = "powersgd"  # recxla.train.checkpoint files its state_dict under this name

    def __init__(self, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
                 group: Optional[dist.ProcessGroup] = None,
                 node_group: Optional[dist.ProcessGroup] = None,
                 cross_group: Optional[dist.ProcessGroup] = None, rank: int = 1,
                 start_step: int = DEFAULT_START_STEP, error_feedback: bool = True,
                 seed: int = 0):
        for name, value, least in (("rank", rank, 1), ("start_step", start_step, 0),
                                   ("seed", seed, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{OP}: {name} must be an int >= {least}, got {value!r}")
        super().__init__(named_parameters, group, node_group, cross_group)
        self.rank, self.start_step = rank, start_step
        self.error_feedback = bool(error_feedback)
        # Per parameter index: the factors' columns (0: never compressed).
        self.factor_rank: List[int] = [self._factor_columns(p) for p in self.parameters]
        # The state, allocated now so that state_dict() returns the live tensors (a checkpoint
        # loads into them in place): residuals [numel] and Q [m, r] of the compressed
        # parameters, each parameter's count of averages.
        self.residuals: Dict[int, torch.Tensor] = {}
        self.q: Dict[int, torch.Tensor] = {}
        self.averages = torch.zeros(len(self.names), dtype=torch.int64)
        # The residuals viewed [n, m], made once (views of the state: a load keeps them).
        self.residual_matrices: Dict[int, torch.Tensor] = {}
        for i, p in enumerate(self.parameters):
            if self.factor_rank[i]:
                self.residuals[i] = torch.zeros(p.numel(), dtype=torch.float32,
                                                device=self.device)
                self.residual_matrices[i] = self.residuals[i].view(_matrix_shape(p))
                self.q[i] = self._first_q(i, seed)
        # The buckets of this backward held back by start_bucket: (parameters, and where their
        # gradients lie: _bucket_sources); per bucket layout, whether its buffer holds them.
        self._held: List[Tuple[list, List[torch.Tensor], List[Tuple[int, int]]]] = []
        self._flat_layouts: Dict[Tuple[int, ...], bool] = {}

    def _factor_columns(self, p: torch.Tensor) -> int:
        """The factors' columns of `p` (0: it travels whole)."""
        n, m = _matrix_shape(p)
        r = min(n, m, self.rank) if p.dim() >= 2 else 0
        return r if r and n * m >= MIN_COMPRESSION * (n + m) * r else 0

    def _first_q(self, i: int, seed: int) -> torch.Tensor:
        m = _matrix_shape(self.parameters[i])[1]
        g = torch.Generator().manual_seed(hashing.mix_scalar(seed, _TAG_Q, i))
        return torch.randn(m, self.factor_rank[i], generator=g).to(self.device)

    def sum_async(self, flat: torch.Tensor):
        """Starts summing `flat` in place over the ranks (by node where the groups say);
        -> an object whose wait() completes it."""
        with carrying("dense"):
            if self.node_group is not None:
                return all_reduce_by_node(flat, self.node_group, self.cross_group)
            return dist.all_reduce(flat, group=self.cross_group, async_op=True)

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, torch.Tensor]:
        """{"<parameter>.averages": int64 [], and for a compressed parameter ".residual"
        float32 [numel] and ".q" float32 [m, r]} of this rank (residuals differ between
        ranks): what a resumed run needs to continue bit for bit. Views of the live state:
        loading into them in place (as torch.distributed.checkpoint does) restores it."""
        state = {}
        for i, name in enumerate(self.names):
            state[f"{name}.averages"] = self.averages[i]
            if self.factor_rank[i]:
                state[f"{name}.residual"] = self.residuals[i]
                state[f"{name}.q"] = self.q[i]
        return state

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        """Restores the state of `state` (a state_dict() of the same parameters and rank);
        raises ValueError naming the key that does not fit."""
        own = self.state_dict()
        missing = sorted(set(own) - set(state))
        if missing:
            raise ValueError(f"{OP}: load_state_dict: {missing[0]!r} is missing")
        for key, value in state.items():
            if key not in own:
                raise ValueError(f"{OP}: load_state_dict: {key!r} is no state of these "
                                 "parameters at this rank")
            if not isinstance(value, torch.Tensor) or value.shape != own[key].shape:
                raise ValueError(f"{OP}: load_state_dict: {key!r} must be shaped "
                                 f"{list(own[key].shape)}, got {getattr(value, 'shape', value)!r}")
        for key, value in state.items():
            if value is not own[key]:
                own[key].copy_(value)

    # -- the collectives --------------------------------------------------------------------
    def start(self, params: Sequence[torch.Tensor],
              grads: Sequence[torch.Tensor]) -> PowerSGDAllReduceHandle:
        """Starts averaging `grads` (the gradients of `params`, contiguous, written in place at
        wait()). Every rank calls it with the same parameters; their order does not matter
        (the set travels in the order of the named_parameters)."""
        indices = self.indices_of(params)
        grads = list(grads)
        if len(grads) != len(indices):
            raise ValueError(f"{OP}: start needs one gradient per parameter, got "
                             f"{len(indices)} parameters and {len(grads)} gradients")
        for i, g in zip(indices, grads):
            if g.shape != self.parameters[i].shape:
                raise ValueError(f"{OP}: the gradient of {self.names[i]!r} is shaped "
                                 f"{list(g.shape)}, its parameter "
                                 f"{list(self.parameters[i].shape)}")
            if not g.is_contiguous():
                raise ValueError(f"{OP}: the gradient of {self.names[i]!r} must be contiguous "
                                 "(the averages are written where it lies)")
        return self._start(indices, grads, [(k, 0) for k in range(len(grads))])

    def start_bucket(self, bucket) -> Optional[PowerSGDAllReduceHandle]:
        """The buckets of a backward travel as one set, started with the last (the module
        docstring says why) -> its handle; None for the others. A DDP bucket's gradients are
        read from its flat buffer, where DDP lays them out one after another in the bucket's
        parameter order (not one view per gradient a step)."""
        params = bucket.parameters()
        self._held.append((params, *self._bucket_sources(bucket, params)))
        if not bucket.is_last():
            return None
        held, self._held = self._held, []
        sources, places = [], []
        for _, bucket_sources, bucket_places in held:
            places += [(len(sources) + source, offset) for source, offset in bucket_places]
            sources += bucket_sources
        return self._start(self.indices_of([p for params, _, _ in held for p in params]),
                           sources, places)

    def _bucket_sources(self, bucket, params: List[torch.Tensor]
                        ) -> Tuple[List[torch.Tensor], List[Tuple[int, int]]]:
        """Where the bucket's gradients lie: ([its buffer], each one's (0, offset)) when they
        are views of the buffer one after another in parameter order (DDP's layout: checked
        once per bucket layout against its views), else (the gradients, (k, 0))."""
        offsets = [0]
        for p in params[:-1]:
            offsets.append(offsets[-1] + p.numel())
        key = tuple(id(p) for p in params)
        if key not in self._flat_layouts:
            buffer = bucket.buffer()
            storage = buffer.untyped_storage().data_ptr()
            self._flat_layouts[key] = all(
                g.untyped_storage().data_ptr() == storage and g.is_contiguous() and
                g.storage_offset() - buffer.storage_offset() == offset
                for g, offset in zip(bucket.gradients(), offsets))
        if self._flat_layouts[key]:
            return [bucket.buffer()], [(0, offset) for offset in offsets]
        return list(bucket.gradients()), [(k, 0) for k in range(len(params))]

    def _start(self, indices: List[int], sources: List[torch.Tensor],
               places: List[Tuple[int, int]]) -> PowerSGDAllReduceHandle:
        """The set of parameters `indices` whose gradients lie in `sources` (contiguous) at
        `places`: per parameter (source, element offset)."""
        if not indices or len(set(indices)) != len(indices):
            raise ValueError(f"{OP}: start needs one gradient per parameter, each parameter "
                             f"once, at least one; got {len(indices)} parameters")
        order = sorted(range(len(indices)), key=lambda k: indices[k])
        indices = [indices[k] for k in order]
        places = [places[k] for k in order]
        averages = self.averages.tolist()  # one read, not one per parameter
        pieces, compressed = [], []
        for i, (source, offset) in zip(indices, places):
            numel = self.parameters[i].numel()
            if not self.factor_rank[i] or averages[i] < self.start_step:
                pieces.append((source, offset, numel))
            else:
                grad = sources[source]
                shape = self.residual_matrices[i].shape
                compressed.append((i, grad.as_strided(shape, (shape[1], 1),
                                                      grad.storage_offset() + offset)))
        whole = _WholeGradients(sources, pieces)
        orthonormalize_columns([self.q[i] for i, _ in compressed])
        factor_sizes = [self.residual_matrices[i].shape[0] * self.factor_rank[i]
                        for i, _ in compressed]
        buffer = torch.empty(whole.numel + sum(factor_sizes), dtype=torch.float32,
                             device=self.device)
        if whole.numel:
            whole.read(buffer[:whole.numel])
        matrices, factors, at = [], [], whole.numel
        for (i, grad), size in zip(compressed, factor_sizes):
            matrix = grad.float() if grad.dtype != torch.float32 else grad
            matrix = matrix + self.residual_matrices[i] if self.error_feedback \
                else matrix.clone()
            matrices.append((i, matrix, grad))
            rank = self.factor_rank[i]
            factors.append(torch.mm(matrix, self.q[i], out=buffer.as_strided(
                (matrix.shape[0], rank), (rank, 1), at)))
            at += size
        work = self.sum_async(buffer)
        return PowerSGDAllReduceHandle(self, indices, whole, matrices, factors, buffer, work)

    def drop_pending(self) -> None:
        super().drop_pending()
        self._held = []


def powersgd_compress_hook(state: PowerSGDAllReduce,
                           bucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that averages the gradients as low-rank factors with error
    feedback:

        ddp.register_comm_hook(PowerSGDAllReduce.for_ddp(ddp), powersgd_compress_hook)

    (`for_ddp(ddp, node_group=..., cross_group=...)` by node). The backward's buckets travel
    together when DDP hands over the last, from the backward's thread. Unlike torch's
    powerSGD_hook, the average does not depend on DDP's buckets, and `state.state_dict()`
    saved with the model resumes a run bit for bit."""
    return state.hook(bucket)
