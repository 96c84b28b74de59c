"""The argument every pooled embedding op takes: one lookup of bags over deduplicated ids.

`BagLookup` names the nine arguments that the ops of csrc/embedding_bag.cpp share, in their
schema's order, so that `op(*lookup.op_args())` calls the flat schema as it is. The public
functions (recxla.ops.embedding_bag), their checks (recxla.ops.embedding_bag_checks), the
reference (recxla.reference.embedding_bag) and the Triton launchers (which read its fields
without importing it: the kernels import only leaves) take one.
"""

from typing import NamedTuple, Optional, Sequence

import torch


class BagLookup(NamedTuple):
    """One pooled lookup over deduplicated ids: T tables, F features, B samples, N ids (bag by
    bag, feature-major: feature f's bags are f * B .. (f + 1) * B - 1), U unique rows.

    weights: T float32 [E_t, D_t] contiguous, the tables.
    unique_values: int32/int64 [U], the rows read, table by table (each table's segment
        strictly increasing for the fused update).
    unique_offsets: int64 [T + 1], table t's segment of unique_values is
        unique_offsets[t] .. unique_offsets[t + 1].
    inverse: int64 [N], each id's index into unique_values (inside its table's segment).
    offsets: int64 [F * B + 1], the bag bounds in inverse (0 first, N last, non-decreasing).
    per_sample_weights: float32 [N] or None; with mean pooling a bag gives
        sum(w * row) / length, as FBGEMM's TBE.
    feature_table: F ints, the table each feature reads (features in any table order; the
        output's columns follow the features).
    pooling: T ints, SUM (0) or MEAN (1) per table (recxla.ops.embedding_bag_enums).
    batch_size: B, the bags per feature.

    The pooled output is float32 [B, sum_f D_{feature_table[f]}].
    """

    weights: Sequence[torch.Tensor]
    unique_values: torch.Tensor
    unique_offsets: torch.Tensor
    inverse: torch.Tensor
    offsets: torch.Tensor
    per_sample_weights: Optional[torch.Tensor]
    feature_table: Sequence[int]
    pooling: Sequence[int]
    batch_size: int

    def op_args(self) -> "BagLookup":
        """The same lookup with weights, feature_table and pooling as lists (a caller may pass
        any sequence), the form in which the kernels take them: unpack it into an op,
        `torch.ops.recxla.embedding_bag_forward(*lookup.op_args())`."""
        return self._replace(weights=list(self.weights), feature_table=list(self.feature_table),
                             pooling=list(self.pooling))
