"""The contracts of recxla's sharded embedding modules, in one place (as TorchRec keeps its own in
`torchrec/distributed/types.py`).

recxla shards two kinds of module, built from the same parts and driven by the same steps:

    ShardedEmbeddingBagCollection   pooled embeddings: a KeyedTensor [B, sum of dims]
    ShardedEmbeddingCollection      sequence embeddings: Dict[str, JaggedTensor], a row per id

Each is a thin TorchRec module over `ShardedParts` (sharded_parts.py, made by
sharded_builder.py) and one `ShardedSteps` object over those parts (sharded_steps.py). The two
differ in their receiver only: the pooled module's output dist pools, the sequence module's
expands each unique row to the positions of its ids (sequence_output.py).

`PipelinedModule` is what recxla.pipeline.TrainPipeline relies on: a module that has `steps`
(`EmbeddingSteps`). The pipeline finds such modules in a model, calls their steps one by one
where its schedule places them (docs/architecture.md), and stages each micro-batch's output
for the module's next forward (`EmbeddingSteps.stage_output`).
"""

from dataclasses import dataclass
from typing import (Any, Callable, List, Optional, Protocol, Sequence, Tuple, Union,
                    runtime_checkable)

import torch
from torch import nn

# What EmbeddingSteps.tables_version returns: equal values, unchanged tables.
TablesVersion = Tuple[int, List[int]]


@dataclass(frozen=True)
class PooledTables:
    """What a lookup of this rank's pooled tables reads.

    weights: per local pooled table t, its shard: the live float32 [rows_t, cols_t] Parameter
        (the fused optimizer updates it in place);
    slot_table: per owner slot j (LookupInput's slot order: bag (j, b) is
        offsets[j * B + b] .. offsets[j * B + b + 1]), its local table t;
    pooling: per local pooled table, recxla.ops.embedding_bag.SUM or MEAN (row-sharded
        tables: SUM; their MEAN is divided at the receiver).
    """

    weights: Tuple[nn.Parameter, ...]
    slot_table: Tuple[int, ...]
    pooling: Tuple[int, ...]


class EmbeddingSteps(Protocol):
    """The steps of one sharded module, as a pipeline calls them (sharded_steps.py documents
    each; LookupInput, Message, RowBags, RowInput, EarlyLookup and EarlyRows are the types of
    input_dist.py, output_dist.py, row_exchange.py, early_lookup.py and early_rows.py).

    An exchange's output is assembled in two steps: `assemble_output` gives its values (the
    tensor whose gradient `start_gradient` sends back), `form_output` what the module's forward
    returns from them: a KeyedTensor (pooled) or a Dict[str, JaggedTensor] (sequence).
    """

    layout: Any  # ShardLayout: where every shard lives; layout.rank is this rank

    def start_input_dist(self, features, micro_batch_sizes: Optional[Sequence[int]] = None):
        ...

    def receive_lengths(self, input_lengths: torch.Tensor) -> Optional[torch.Tensor]:
        ...

    def to_device(self, lookup_input):
        ...

    def lookup_rows(self, lookup_input) -> Optional[torch.Tensor]:
        ...

    def lookup_pooled(self, lookup_input, rows_follow: bool = False) -> torch.Tensor:
        ...

    def early_lookup(self, next_input, current_input):
        ...

    def start_early_rows(self, next_input, current_input, row_bags):
        ...

    def output_message(self, batch: int, row_bags, micro_batch: int = 0):
        ...

    def start_output(self, pooled: torch.Tensor, source_batches: List[int], message,
                     row_block: Optional[torch.Tensor] = None, rows=None):
        ...

    def assemble_output(self, received: torch.Tensor, message,
                        lengths: Optional[torch.Tensor]) -> torch.Tensor:
        ...

    def form_output(self, values: torch.Tensor, lengths: Optional[torch.Tensor]) -> Any:
        ...

    def start_gradient(self, grad: torch.Tensor, source_batches: List[int], message,
                       lengths: Optional[torch.Tensor], rows):
        ...

    def update_from_message(self, flat: torch.Tensor, lookup_input,
                            output: Optional[torch.Tensor],
                            row_output: Optional[torch.Tensor]) -> bool:
        ...

    def unpack_gradient(self, flat: torch.Tensor, source_batches: List[int], rows, k: int,
                        first_sample: int, gradient: Optional[torch.Tensor],
                        row_gradient: Optional[torch.Tensor]) -> None:
        ...

    def stage_output(self, output: Union[Any, Callable[[], Any]]) -> None:
        ...

    def end_staging(self) -> bool:
        ...

    def count_step(self) -> None:
        ...

    def tables_version(self) -> TablesVersion:
        ...

    @property
    def replicas(self) -> Any:  # ReplicaSync in 2D training, else None
        ...


@runtime_checkable
class PipelinedModule(Protocol):
    """A sharded module recxla.pipeline drives step by step: its `steps`."""

    steps: EmbeddingSteps
