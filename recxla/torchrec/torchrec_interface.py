"""TorchRec's interface of a recxla sharded module, composed from its steps: one implementation
for the pooled and the sequence module (types.py).

TorchRec's DistributedModelParallel and pipelines drive a sharded module through
`input_dist(ctx, features)` -> Awaitable[Awaitable[KJTList]], `compute(ctx, dist_input)`,
`output_dist(ctx, output)` -> LazyAwaitable, and `forward`, which runs the three. `TorchRecFace`
gives those from the module's `ShardedSteps`, with the batch's state in a `ShardedContext`:

    input_dist   start_input_dist (the ids' two all-to-alls, awaited in two steps by TorchRec)
    compute      to_device + lookup (the owner's pooled lookup and requested rows)
    output_dist  output_message + start_output; the awaitable's wait: the output dist's finish
                 (assemble with autograd: the backward sends the gradient back and runs the fused
                 update) and form_output

What each module adds to an output it formed (the data-parallel tables, looked up on the
batch's features outside recxla's dists; a sequence module's indices) is its `complete`
callable, used both here and on the outputs a recxla pipeline staged (`staged_output`).

TorchRec calls these as methods of the module, under TorchRec's names: `TorchRecMethods` gives
both modules those methods, each a one-line delegation to the module's `_face`, `steps` and
`parts` (the machinery itself is composed, not inherited).
"""

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.types import LazyAwaitable, Multistreamable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recxla.torchrec.input_dist import LookupInput
from recxla.torchrec.output_dist import Message
from recxla.torchrec.row_exchange import RowBags, RowInput
from recxla.torchrec.sharded_parts import ShardedParts
from recxla.torchrec.sharded_state_dict import reset_local_shards
from recxla.torchrec.sharded_steps import ShardedSteps

# The one "sharding type" TorchRec's input-dist awaitables are told about: recxla's dists serve
# every sharding type of the plan at once.
SHARDING_NAME = "recxla"


@dataclass
class ShardedContext(Multistreamable):
    """Per-batch state between input_dist and the output: this rank's batch size, the
    sources' batch sizes at the owner, the receiver's lengths (ShardedSteps.receive_lengths),
    this rank's bags of row tables, the owner's requested rows, and the batch as the input
    dist routed it (a variable batch expanded), for what the module looks up on its own."""

    batch_size: int = 0
    source_batches: List[int] = field(default_factory=list)
    lengths: Optional[torch.Tensor] = None
    row_bags: Optional[RowBags] = None
    rows: Optional[RowInput] = None
    features: Optional[KeyedJaggedTensor] = None
    # TorchRec's input-dist awaitables look for per-sharding contexts; recxla keeps none.
    sharding_contexts: List[Any] = field(default_factory=list)

    def record_stream(self, stream) -> None:
        if self.lengths is not None and self.lengths.is_cuda:
            self.lengths.record_stream(stream)


class TorchRecFace:
    """TorchRec's input_dist / compute / output_dist of one sharded module (see the module
    docstring).

    Args:
        steps: the module's ShardedSteps.
        module_fqn: the module's path in the model (TorchRec's awaitables log it).
        complete: (formed output, the batch's features) -> the module's output: what the
            module adds to form_output's output (identity where it adds nothing).
        samples: a formed output -> its number of samples, or None where it cannot tell
            (checks a staged output's batch).
    """

    def __init__(self, steps: ShardedSteps, module_fqn: Optional[str],
                 complete: Callable[[Any, Optional[KeyedJaggedTensor]], Any],
                 samples: Callable[[Any], Optional[int]]):
        self.steps, self.module_fqn = steps, module_fqn
        self.complete, self.samples = complete, samples

    def input_dist(self, ctx: ShardedContext, features: KeyedJaggedTensor):
        """Checks the batch and starts the id all-to-alls. -> Awaitable[Awaitable[KJTList]]
        whose KJTList holds one LookupInput (TorchRec's pipelines wait on it in two steps)."""
        parts = self.steps.parts
        if parts.on_meta:
            raise ValueError(f"{parts.layout.owner}: this module was sharded on the meta device: "
                             "its shards have no values; shard the model onto a real device "
                             "(e.g. DistributedModelParallel(..., device=torch.device('cpu'))) "
                             "to run it")
        awaitable = self.steps.start_input_dist(features)
        lengths = awaitable.input_lengths
        if lengths is not None:  # None: the batch failed its checks (raised at the wait)
            ctx.features = awaitable.features
            ctx.batch_size = lengths.shape[1]
            ctx.lengths = self.steps.receive_lengths(lengths)
            ctx.row_bags = awaitable.row_bags
        return KJTListSplitsAwaitable([awaitable], ctx, self.module_fqn, [SHARDING_NAME])

    def compute(self, ctx: ShardedContext, dist_input: KJTList):
        """The owner's lookup. -> (pooled float32 [sum of the sources' batches, D_owner],
        the row block of its row groups' requested rows or None: ShardedSteps.lookup_rows)."""
        lookup_input: LookupInput = self.steps.to_device(dist_input[0])
        ctx.source_batches = lookup_input.batch_sizes
        ctx.rows = lookup_input.rows
        if ctx.row_bags is not None:
            ctx.row_bags = ctx.row_bags.to(self.steps.parts.device)
        return self.steps.lookup(lookup_input)

    def output_dist(self, ctx: ShardedContext, output) -> LazyAwaitable:
        """Starts the embeddings' all-to-all. -> LazyAwaitable of the module's output."""
        pooled, row_block = output
        message = self.steps.output_message(ctx.batch_size, ctx.row_bags)
        handle, send, _ = self.steps.start_output(pooled, ctx.source_batches, message,
                                                  row_block, ctx.rows)
        return _OutputAwaitable(self, handle, send, message, ctx)

    def finish_output(self, handle, sent: List[int], message: Message, ctx: ShardedContext):
        """output_dist's end (autograd path): waits for the rows and assembles this rank's
        output, whose backward sends the gradient back and counts a fused optimizer step."""
        values = self.steps.parts.output.finish(handle, sent, message, ctx.lengths,
                                                self.steps.count_step)
        return self.complete(self.steps.form_output(values, ctx.lengths), ctx.features)

    def check_not_staging(self) -> None:
        """Before the module's own forward: ValueError where a pipeline's forward runs whose
        staged output this module already gave (the model calls it more than once in one
        forward)."""
        parts = self.steps.parts
        if parts.staging and not parts.staged_outputs:
            raise ValueError(f"{parts.layout.owner}: the model called this sharded module "
                             "more than once in one forward; recxla.pipeline stages one output "
                             "per sharded module and micro-batch, so a model calls each one "
                             "exactly once per forward, on the micro-batch's sparse features")

    def staged_output(self, features: Optional[KeyedJaggedTensor]) -> Any:
        """The output a pipeline staged for this forward (ShardedSteps.stage_output; a callable
        is called for it), completed on the micro-batch's `features`; ValueError when the model
        passed another number of samples."""
        staged = self.steps.parts.staged_outputs
        output = staged.popleft()
        if callable(output):
            output = output()
        samples = self.samples(output)
        if isinstance(features, KeyedJaggedTensor) and samples is not None and \
                features.stride() != samples:
            staged.clear()
            raise ValueError(f"{self.steps.parts.layout.owner}: the pipeline staged embeddings "
                             f"of {samples} samples, but the model passed "
                             f"{features.stride()}; the model must give this module the "
                             "micro-batch's sparse features")
        return self.complete(output, features)


class _OutputAwaitable(LazyAwaitable[Any]):
    def __init__(self, face: TorchRecFace, handle, send, message, ctx: ShardedContext):
        super().__init__()
        self._face, self._handle, self._send, self._message, self._ctx = \
            face, handle, send, message, ctx

    def _wait_impl(self) -> Any:
        handle, self._handle = self._handle, None
        return self._face.finish_output(handle, self._send, self._message, self._ctx)


class TorchRecMethods:
    """TorchRec's methods of a recxla sharded module, delegated to its composed parts: the
    module sets `parts` (ShardedParts), `steps` (ShardedSteps) and `_face` (TorchRecFace). Put
    first among the module's bases, so that they replace the TorchRec class's own."""

    parts: ShardedParts
    steps: ShardedSteps
    _face: TorchRecFace

    def create_context(self) -> ShardedContext:
        return ShardedContext()

    def input_dist(self, ctx: ShardedContext, features: KeyedJaggedTensor):
        """Checks the batch and starts the id all-to-alls (TorchRecFace.input_dist)."""
        return self._face.input_dist(ctx, features)

    def forward(self, *input, **kwargs):
        """TorchRec's forward (input dist, lookup, output dist), unless a pipeline staged this
        step's output (`steps.stage_output`): then that output, for the same batch size."""
        if self.parts.staged_outputs:
            return self._face.staged_output(input[0] if input else kwargs.get("features"))
        self._face.check_not_staging()
        return super().forward(*input, **kwargs)

    def compute(self, ctx: ShardedContext, dist_input: KJTList):
        """The owner's lookup (TorchRecFace.compute)."""
        return self._face.compute(ctx, dist_input)

    def output_dist(self, ctx: ShardedContext, output) -> LazyAwaitable:
        """Starts the embeddings' all-to-all -> LazyAwaitable of the module's output."""
        return self._face.output_dist(ctx, output)

    def compute_and_output_dist(self, ctx: ShardedContext, input: KJTList) -> LazyAwaitable:
        return self.output_dist(ctx, self.compute(ctx, input))

    @property
    def fused_optimizer(self):
        """The ShardedFusedOptimizer of this rank's shards."""
        return self.parts.optim

    @property
    def layout(self):
        """The module's ShardLayout."""
        return self.parts.layout

    @property
    def replicas(self):
        """The module's ReplicaSync in 2D training (recxla.torchrec.replicas), else None."""
        return self.parts.replicas

    def average_replicas(self) -> None:
        """2D training with sync="weights": the replicas averaged now (ShardedSteps)."""
        self.steps.average_replicas()

    def reset_parameters(self) -> None:
        """Re-initializes every local shard with its table's init_fn."""
        reset_local_shards(self.parts)

    def update_shards(self, *args, **kwargs) -> None:
        raise NotImplementedError(f"{self.parts.layout.owner}: resharding a live module is not "
                                  "supported; save a checkpoint and load it into a module "
                                  "sharded the new way")

    def extra_repr(self) -> str:
        return self.parts.describe()
