"""The synthetic world behind `SyntheticRankingDataset`: users, items, categories and the bags
of ids each of them carries, all defined by hashing ids (`recxla.data.hashing`).

Nothing is stored: a user's attributes, history and interests, an item's category and
attributes, the hidden label weight of every key, are pure functions of (seed, feature, id).
Every batch, worker and rank therefore sees the same world, at no memory cost, and generation
is a few vectorized integer operations per id.

Items: item = category + num_categories * j, where the category follows a Zipf law over
num_categories and j a Zipf law over the items of a category; so an item's category is
item % num_categories and each category holds popular and rare items. A draw for a user takes
one of the user's `interests` categories with probability `interest_share`, else a category
from the global law; interest categories are themselves global-law draws, so the marginal
distribution of items is the same with or without interests.
"""

from typing import Dict, Tuple

import torch

from recxla.data import hashing
from recxla.data.profiles import Profile, SparseFeature

ENTITIES = ("user", "item", "category")
_TAG_BAG, _TAG_LEN, _TAG_WEIGHT, _TAG_INTEREST, _TAG_HISTORY, _TAG_LATENT = range(11, 17)


def jagged_positions(lengths: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """For bags of `lengths` [E]: (owner [N], position in its bag [N]), int64."""
    total = int(lengths.sum())
    owner = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=total
    )
    starts = torch.cumsum(lengths, 0) - lengths
    return owner, torch.arange(total, device=lengths.device) - starts.index_select(0, owner)


class World:
    """Hash-defined users, items and categories of `profile` under `seed`."""

    def __init__(self, profile: Profile, seed: int):
        self.profile = profile
        self.seed = seed
        self.items_per_category = profile.num_items // profile.num_categories
        self.salts = [
            {t: hashing.mix_scalar(seed, i, t) for t in (_TAG_BAG, _TAG_LEN, _TAG_WEIGHT)}
            for i in range(len(profile.features))
        ]
        self.interest_salt = hashing.mix_scalar(seed, _TAG_INTEREST)
        # One-id features of an entity are computed together as the columns of one [E, K]
        # tensor: a batch then costs a few dozen tensor operations, not a few per feature.
        col = lambda vals: torch.tensor(vals, dtype=torch.int64).reshape(1, -1)  # noqa: E731
        self.single: Dict[str, dict] = {}
        for entity in ENTITIES:
            idx = [
                i for i, f in enumerate(profile.features)
                if f.entity == entity and tuple(f.pooling) == (1, 1)
            ]  # fmt: skip
            feats = [profile.features[i] for i in idx]
            self.single[entity] = {
                "index": idx,
                "rows": col([f.num_embeddings for f in feats]),
                "is_id": col([f.role == "id" for f in feats]).bool(),
                "bag_salt": col([self.salts[i][_TAG_BAG] for i in idx]),
                "weight_salt": col([self.salts[i][_TAG_WEIGHT] for i in idx]),
            }
        self.multi = {
            entity: [
                i for i, f in enumerate(profile.features)
                if f.entity == entity and tuple(f.pooling) != (1, 1)
            ]
            for entity in ENTITIES
        }  # fmt: skip

    # ---- items -------------------------------------------------------------------------------

    def interest_categories(self, users: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Category of interest number `slot` of each user: int64, users' shape."""
        h = hashing.splitmix64(hashing.splitmix64(users ^ self.interest_salt) + slot)
        p = self.profile
        return hashing.zipf_ranks(hashing.uniform(h), p.num_categories, p.zipf)

    def draw_items(self, users, u_choice, u_category, u_item) -> torch.Tensor:
        """Items for `users` from float64 uniforms of the same shape: int64 item ranks."""
        p = self.profile
        from_interest = u_choice < p.interest_share
        slot = (u_choice / max(p.interest_share, 1e-300) * p.interests).to(torch.int64)
        slot = slot.clamp_(max=p.interests - 1)
        category = torch.where(
            from_interest,
            self.interest_categories(users, slot),
            hashing.zipf_ranks(u_category, p.num_categories, p.zipf),
        )
        j = hashing.zipf_ranks(u_item, self.items_per_category, p.zipf)
        return category + p.num_categories * j

    def category_of(self, items: torch.Tensor) -> torch.Tensor:
        return torch.remainder(items, self.profile.num_categories)

    # ---- bags --------------------------------------------------------------------------------

    def single_bags(self, entity: str, ents: torch.Tensor) -> torch.Tensor:
        """Ids of the entity's one-id features for distinct `ents` [E] -> int64 [E, K]."""
        g = self.single[entity]
        h = hashing.splitmix64(ents.reshape(-1, 1) ^ g["bag_salt"])
        ranks = hashing.zipf_ranks(hashing.uniform(h), g["rows"], self.profile.zipf)
        ranks = torch.where(g["is_id"], ents.reshape(-1, 1), ranks)
        return hashing.scramble(ranks, g["rows"], g["bag_salt"])

    def multi_bags(self, fi: int, ents: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Bags of multi-hot feature `fi` for distinct `ents` [E] -> (lengths [E], values)."""
        f: SparseFeature = self.profile.features[fi]
        salts = self.salts[fi]
        lo, hi = f.pooling
        if lo == hi:
            lengths = torch.full_like(ents, lo)
        else:
            u = hashing.uniform(hashing.splitmix64(ents ^ salts[_TAG_LEN]))
            lengths = (lo + (u * (hi - lo + 1)).to(torch.int64)).clamp_(max=hi)
        owner, pos = jagged_positions(lengths)
        entity_hash = hashing.splitmix64(ents ^ salts[_TAG_BAG])
        h = hashing.splitmix64(entity_hash.index_select(0, owner) + pos)
        if f.role == "history":
            # Items the user interacted with: the same law as the user's candidates.
            h2 = hashing.splitmix64(h ^ _TAG_HISTORY)
            ranks = self.draw_items(
                ents.index_select(0, owner),
                hashing.uniform(h),
                hashing.uniform(h2),
                hashing.uniform(hashing.splitmix64(h2)),
            )
        else:
            ranks = hashing.zipf_ranks(hashing.uniform(h), f.num_embeddings, self.profile.zipf)
        return lengths, hashing.scramble(ranks, f.num_embeddings, salts[_TAG_BAG])

    # ---- hidden label model ------------------------------------------------------------------

    def single_weights(self, entity: str, ids: torch.Tensor) -> torch.Tensor:
        """Hidden weights of the ids of `single_bags`, summed per entity: float64 [E]."""
        g = self.single[entity]
        return hashing.centered(hashing.splitmix64(ids ^ g["weight_salt"])).sum(1)

    def bag_weight_mean(self, fi: int, lengths: torch.Tensor, values: torch.Tensor):
        """Mean hidden weight of each bag of feature `fi`: float64 [E] (0 for an empty bag)."""
        w = hashing.centered(hashing.splitmix64(values ^ self.salts[fi][_TAG_WEIGHT]))
        owner, _ = jagged_positions(lengths)
        sums = torch.zeros(lengths.numel(), dtype=torch.float64).index_add_(0, owner, w)
        return sums / lengths.clamp(min=1)

    def latent(self, keys: torch.Tensor, tag: int, dims: int) -> torch.Tensor:
        """Per-key standard normals: float64 [len(keys), dims]."""
        base = hashing.splitmix64(keys ^ hashing.mix_scalar(self.seed, _TAG_LATENT, tag))
        # Column j is normal(splitmix64(base + 2j), splitmix64(base + 2j + 1)), all columns in
        # one pass over a [K, 2 * dims] block (a few ops per batch, not a few per column).
        h = hashing.splitmix64(base.reshape(-1, 1) + torch.arange(2 * dims, dtype=torch.int64))
        return hashing.normal(h[:, 0::2], h[:, 1::2])
