"""How much of the next batch's embeddings could leave before this batch's update, per table.

The update of batch n changes exactly the rows batch n read (on any rank). Batch n+1's
embeddings can travel before that update only where they do not depend on those rows:

- a table exchanged as rows (recxla.torchrec.row_exchange): each rank's unique rows of batch
  n+1 that batch n did not read are final before the update and leave early, each row once
  (recxla.torchrec.early_rows); `rows_late` is the share that must wait;
- a pooled table: a bag is a sum over its rows, so an early bag is exact only if none of its
  rows changes; `bags_late` is the share of batch n+1's bags that hold a row batch n read, the
  bags whose early value would need a correction after the update (as many bytes again).

`early_send_shares` measures both on real batches, so the choice (early rows for row tables,
nothing early for pooled ones on Zipf data, where most bags hold a hot row) rests on the
user's data rather than on an assumption.
"""

import dataclasses
from typing import List, Sequence

import torch

OP = "recxla.planner.early_send"


@dataclasses.dataclass(frozen=True)
class EarlyShare:
    """One table over the measured steps. bags: batch n+1's bags counted (all ranks);
    bags_late: the share of them holding a row batch n read; rows: each rank's unique rows of
    batch n+1, summed over ranks (what row exchange sends); rows_late: the share of those that
    batch n read; unique_per_bag: rows / bags (below ~0.9 the trainer exchanges rows)."""

    table: str
    bags: int
    bags_late: float
    rows: int
    rows_late: float

    @property
    def unique_per_bag(self) -> float:
        return self.rows / self.bags if self.bags else 0.0


def _features(by_key, names: Sequence[str]):
    """(ids, lengths) of `names` in one batch's features by key, concatenated."""
    values = [by_key[n].values() for n in names]
    lengths = [by_key[n].lengths() for n in names]
    return torch.cat(values), torch.cat(lengths)


def early_send_shares(tables: Sequence, steps: Sequence[Sequence]) -> List[EarlyShare]:
    """tables: EmbeddingBagConfigs; steps[n][r]: rank r's KeyedJaggedTensor of step n (at
    least 2 steps, the same ranks each). -> one EarlyShare per table, over steps 1 ..
    len(steps) - 1 (each against the step before it)."""
    if len(steps) < 2:
        raise ValueError(f"{OP}: early_send_shares needs 2 steps or more (each step is judged "
                         f"against the one before it), got {len(steps)}")
    ranks = {len(s) for s in steps}
    if len(ranks) != 1 or 0 in ranks:
        raise ValueError(f"{OP}: every step needs the same number of ranks' batches (>= 1), "
                         f"got {sorted(ranks)}")
    steps = [[batch.to_dict() for batch in step] for step in steps]  # once, not per table
    out = []
    for config in tables:
        names = list(config.feature_names)
        bags = bags_late = rows = rows_late = 0
        for before, after in zip(steps[:-1], steps[1:]):
            read = torch.unique(torch.cat([_features(b, names)[0] for b in before]))
            for batch in after:
                ids, lengths = _features(batch, names)
                changed = torch.isin(ids, read)
                bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
                late = torch.zeros(lengths.numel(), dtype=torch.bool)
                late[bag[changed]] = True
                unique = torch.unique(ids)
                bags += lengths.numel()
                bags_late += int(late.sum())
                rows += unique.numel()
                rows_late += int(torch.isin(unique, read).sum())
        out.append(EarlyShare(config.name, bags, bags_late / max(bags, 1), rows,
                              rows_late / max(rows, 1)))
    return out
