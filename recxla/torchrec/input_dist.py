"""The input dist of recxla's sharded EmbeddingBagCollection: each rank's ids to the ranks that
own their rows, deduplicated per (destination rank, table), in two all-to-alls.

    sender   check, route, deduplicate and pack the batch's ids      (id_encoder.py)
    wire     a first all-to-all of one sizes row per rank pair, then one of bytes: per
             destination its bag lengths, ids, inverse index, weights   (id_wire_format.py)
    owner    decode every source's block into the lookup's input       (id_decoder.py)

`IdRouter` runs the two all-to-alls: `start` encodes the batch and sends the sizes; waiting on
what it returns sends the ids; waiting on that decodes them (`LookupInput`), so a pipeline can
place each stage where it wants.

Bad input on one rank (an id out of range, a missing feature, ...) travels as a status in the
first all-to-all, so every rank raises before any id moves: the rank with the bad batch raises
its own error, the others say which rank failed. No rank is left waiting in a collective.
"""

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recxla.host_copy import to_device
from recxla.torchrec import id_wire_format as wire
from recxla.torchrec.comm_stats import CommStats
from recxla.torchrec.id_decoder import IdDecoder, LookupInput
from recxla.torchrec.id_encoder import IdEncoder, SendBlocks
from recxla.torchrec.row_exchange import RowBags
from recxla.torchrec.shard_layout import ShardLayout
from recxla.torchrec.variable_batch import expand_variable_batch

__all__ = ["IdRouter", "IdsInFlight", "InputDistError", "LookupInput", "SizesInFlight"]


class InputDistError(ValueError):
    """A rank's batch failed its checks; raised on every rank before any id moved."""


class IdRouter:
    """The sending and receiving halves of the input dist for one sharded module.

    Args:
        layout: the module's ShardLayout (its rank is this process's rank in `group`).
        group: the process group of the all-to-alls.
        device: where the ids are routed and decoded (CPU for a GPU module).
        is_weighted: batches carry per-sample weights.
        dedup: allow the deduplicated encodings (False: always raw ids).
        stats: counters this router adds its bytes to.
        expand_rows: the sequence module's input dist (IdEncoder): every id's position is
            kept, and a variable batch per feature is refused (its jagged output would change).
        max_bag_length: the longest bag a batch may hold (None: no limit).
    """

    def __init__(self, layout: ShardLayout, group: Optional[dist.ProcessGroup],
                 device: torch.device, is_weighted: bool, dedup: bool, stats: CommStats,
                 expand_rows: bool = False, max_bag_length: Optional[int] = None):
        self.layout = layout
        self.group = group
        self.device = device
        self.stats = stats
        self.expand_rows = expand_rows
        self.encoder = IdEncoder(layout, device, is_weighted, dedup, stats, expand_rows,
                                 max_bag_length)
        self.decoder = IdDecoder(layout, self.encoder.rows, device, is_weighted)

    def require(self, features: Sequence[str]) -> None:
        """Check that every batch also holds `features`: those of tables the sharded module
        looks up elsewhere (data-parallel ones), checked on every rank before any id moves,
        like the layout's own."""
        self.encoder.required_features = list(dict.fromkeys(
            list(self.encoder.required_features) + list(features)))

    def start(self, features: KeyedJaggedTensor,
              micro_batch_sizes: Optional[Sequence[int]] = None) -> "SizesInFlight":
        """Check and route `features` and start the first all-to-all. Never raises for bad
        input: the error is raised on every rank by the returned awaitable's wait().

        micro_batch_sizes: M ints summing to the batch size: the batch's samples are M
            micro-batches one after another, and the owner orders its batch micro-batch by
            micro-batch (see LookupInput). None: one micro-batch. Every rank must pass the
            same M.
        """
        try:
            if isinstance(features, KeyedJaggedTensor) and features.variable_stride_per_key():
                if self.expand_rows:
                    raise ValueError(f"{self.layout.owner}: a batch with variable batch per "
                                     "feature is not supported for sequence embeddings; give "
                                     "every feature the same batch size")
                features = expand_variable_batch(features)
                if micro_batch_sizes is not None and len(micro_batch_sizes) > 1:
                    raise ValueError(f"{self.layout.owner}: a batch with variable batch per "
                                     "feature cannot be split into micro-batches; expand it "
                                     "first (recxla.torchrec.variable_batch."
                                     "expand_variable_batch) or use one micro-batch")
            batch = features.stride() if isinstance(features, KeyedJaggedTensor) else 0
            micro = [batch] if micro_batch_sizes is None else [int(m) for m in micro_batch_sizes]
            if any(m < 0 for m in micro) or sum(micro) != batch:
                raise ValueError(f"{self.layout.owner}: micro_batch_sizes {micro} must be >= 0 "
                                 f"and sum to the batch size {batch}")
            blocks = self.encoder.encode(features, micro)
            error = None
        except (ValueError, TypeError, IndexError) as e:
            blocks, error = None, e
            micro = [0] * (1 if micro_batch_sizes is None else len(micro_batch_sizes))
        world = self.layout.world_size
        # One sizes row per destination, its fields in wire.BlockMeta's order (made on the
        # host in one call).
        if blocks is None:
            rows = [[wire.STATUS_BAD_INPUT] + [0] * (wire.META_FIELDS - 1 + len(micro))] * world
        else:
            rows = [[*wire.BlockMeta(wire.STATUS_OK, blocks.batch, blocks.num_ids[d],
                                     blocks.num_unique[d], blocks.encoding[d],
                                     blocks.num_row_ids[d]), *micro] for d in range(world)]
        meta = torch.tensor(rows, dtype=torch.int64)
        # The sizes cross the links too: one row to and from each other rank.
        self.stats.id_bytes_sent += (world - 1) * wire.meta_row_bytes(len(micro))
        self.stats.id_bytes_received += (world - 1) * wire.meta_row_bytes(len(micro))
        meta = to_device(meta, self.device)
        received = torch.empty_like(meta)
        work = dist.all_to_all_single(received, meta, group=self.group, async_op=True)
        awaitable = SizesInFlight(self, work, received, blocks, error, meta)
        awaitable.features = features  # as routed (a variable batch expanded)
        return awaitable


class SizesInFlight(Awaitable["IdsInFlight"]):
    """The sizes' all-to-all in flight; wait() checks every rank's status and starts the
    ids' all-to-all (-> IdsInFlight), or raises the batch's error on every rank."""

    def __init__(self, router: IdRouter, work, received: torch.Tensor,
                 blocks: Optional[SendBlocks], error: Optional[Exception], sent: torch.Tensor):
        super().__init__()
        self._router, self._work, self._received = router, work, received
        self._blocks, self._error, self._sent = blocks, error, sent

    @property
    def input_lengths(self) -> Optional[torch.Tensor]:
        """This rank's bag lengths [input slots, B] (None when its batch failed its checks)."""
        return self._blocks.input_lengths if self._blocks is not None else None

    @property
    def row_bags(self) -> Optional[RowBags]:
        """This rank's bags of row tables (None without row tables or on bad input)."""
        return self._blocks.row_bags if self._blocks is not None else None

    def _wait_impl(self) -> "IdsInFlight":
        router = self._router
        self._work.wait()
        meta = self._received.cpu().tolist()
        if self._error is not None:
            raise self._error
        failed = [r for r, row in enumerate(meta) if row[0] != wire.STATUS_OK]
        if failed:
            raise InputDistError(
                f"{router.layout.owner}: the batch of rank(s) {failed} failed its checks (that "
                "rank raised the reason); no ids were exchanged")
        me = router.layout.rank
        recv_sizes = router.decoder.block_sizes(meta)
        for r, size in enumerate(recv_sizes):
            if r != me:
                router.stats.id_bytes_received += size
        received = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=router.device)
        work = dist.all_to_all_single(received, self._blocks.buffer, recv_sizes,
                                      self._blocks.nbytes, group=router.group, async_op=True)
        return IdsInFlight(router, work, received, meta, self._blocks)


class IdsInFlight(Awaitable[LookupInput]):
    """The ids' all-to-all in flight; wait() decodes them at the owner (-> LookupInput)."""

    def __init__(self, router: IdRouter, work, received: torch.Tensor, meta, blocks):
        super().__init__()
        self._router, self._work, self._received, self._meta = router, work, received, meta
        self._blocks = blocks  # the send buffer must live until the exchange is done

    def _wait_impl(self) -> LookupInput:
        self._work.wait()
        self._blocks = None
        return self._router.decoder.decode(self._received, self._meta)
