"""Bytes that recxla's sharded modules send and receive, counted as they go."""

from dataclasses import asdict, dataclass, fields
from typing import Dict


@dataclass
class CommStats:
    """Bytes to and from other ranks (a rank's blocks to itself do not cross a link), summed
    since the last `reset()`.

    id_bytes_*: the input dist (both all-to-alls: sizes and ids, lengths, per-sample weights).
    id_bytes_without_dedup: what the same ids would have cost sent as TorchRec's KJT all-to-all
        sends them: every id in the batch's id dtype, lengths in theirs, weights as float32.
    embedding_bytes_*: pooled embeddings in the forward output all-to-all (wire format `fwd`).
    gradient_bytes_*: their gradients in the backward all-to-all (wire format `bwd`).
    rows_sent_early / rows_sent_late: the forward message's cells (pooled bags and
        row-exchange rows) an owner sent before the previous batch's update (early rows:
        recxla.torchrec.early_rows) / after it, counted where early rows run (to every rank,
        itself included).
    steps: forward calls counted.
    """

    steps: int = 0
    id_bytes_sent: int = 0
    id_bytes_received: int = 0
    id_bytes_without_dedup: int = 0
    embedding_bytes_sent: int = 0
    embedding_bytes_received: int = 0
    gradient_bytes_sent: int = 0
    gradient_bytes_received: int = 0
    rows_sent_early: int = 0
    rows_sent_late: int = 0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def as_dict(self) -> Dict[str, int]:
        return asdict(self)

    def add(self, other: "CommStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
