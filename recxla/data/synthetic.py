"""A seeded synthetic ranking log: TorchRec KeyedJaggedTensor batches with dense features and
learnable labels, shaped like real impression logs.

How a batch is made (see `recxla.data.profiles` for the features):
1. Requests. Each request is one user (Zipf over `num_users`) with `request_size` candidate
   items; every candidate is one sample. Part of the candidates come from the user's interest
   categories (`recxla.data.world`). User-side features are functions of the user, so they
   repeat across the samples of a request; item-side features are functions of the item (or of
   its category) and vary. This shared structure, not the Zipf skew alone, is what key-centric
   sample clustering exploits: independent Zipf draws per sample share little.
2. Shuffling. Requests fill a block of `request_spread` batches; the block's samples are
   shuffled and cut into batches. With the default `request_spread=1` all samples of a request
   land in one batch in random positions (logs stored grouped by request and shuffled within a
   batch, the ID-sorted layout of production pipelines); larger values spread a request over
   that many nearby batches, as a shuffle buffer does. The last request of a block is cut short
   at the block's end.
3. Values. An entity's bag is a pure function of (seed, feature, entity) computed by hashing
   (`recxla.data.world`), so the world needs no memory and every batch agrees with the others.
4. Labels. A hidden logistic model: logit = bias + sum over features of a per-key weight
   (averaged over multi-hot bags) + a low-rank user-id x item-id interaction + a linear term
   in the dense features' latent values. label ~ Bernoulli(sigmoid(logit)), about a quarter
   positive. Per-key weights make embedding tables worth learning; the dense term makes even a
   logistic regression beat chance.
Dense features (13): 0-3 user side, 4-5 item side, 6-12 per sample (context); each is
softplus(mu + z) of a standard normal latent z, positive and skewed like log-transformed counts.

Generation is vectorized torch on CPU: entity features are computed once per distinct user,
item or category of the batch, then expanded to samples by a jagged gather.
"""

import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recxla.data import hashing
from recxla.data.profiles import Profile, criteo_kaggle_profile
from recxla.data.world import ENTITIES, World

# Hidden label model: standard deviations of each logit term, and the bias that puts the
# positive rate near 25% (Criteo's is 26%).
SPARSE_STD = 1.2
INTERACTION_STD = 0.6
INTERACTION_DIM = 4
DENSE_STD = 1.0
LABEL_BIAS = -1.45
NUM_USER_DENSE = 4
NUM_ITEM_DENSE = 2

# Salt tags: one independent hash stream per purpose.
_TAG_DENSE, _TAG_INTER, _TAG_BLOCK = 1, 2, 3


@dataclass
class Batch:
    """One training batch of B samples.

    sparse: KeyedJaggedTensor, one key per sparse feature, int64 values, int32 lengths [F * B].
    dense: float32 [B, num_dense]. labels: float32 [B], 0.0 or 1.0.
    request_ids: int64 [B], the request each sample came from (for analysis; None if unknown).
    """

    sparse: KeyedJaggedTensor
    dense: torch.Tensor
    labels: torch.Tensor
    request_ids: Optional[torch.Tensor] = None

    def to(self, device, non_blocking: bool = False) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa
        return Batch(
            self.sparse.to(device, non_blocking=non_blocking),
            move(self.dense),
            move(self.labels),
            move(self.request_ids),
        )

    def pin_memory(self) -> "Batch":
        pin = lambda t: None if t is None else t.pin_memory()  # noqa
        return Batch(
            self.sparse.pin_memory(), pin(self.dense), pin(self.labels), pin(self.request_ids)
        )

    @property
    def batch_size(self) -> int:
        return self.labels.shape[0]


def _check_int(value, name: str, lo: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"SyntheticRankingDataset: {name} must be an int >= {lo}, got {value!r}")
    return value


def _expand(lengths: torch.Tensor, values: torch.Tensor, inverse: torch.Tensor):
    """Jagged gather: bag i of the result is bag inverse[i] of (lengths [E], values)."""
    out_lengths = lengths.index_select(0, inverse)
    starts = torch.cumsum(lengths, 0) - lengths
    out_starts = torch.cumsum(out_lengths, 0) - out_lengths
    total = int(out_lengths.sum())
    src = torch.arange(total) + torch.repeat_interleave(
        starts.index_select(0, inverse) - out_starts, out_lengths, output_size=total
    )
    return out_lengths, values.index_select(0, src)


class SyntheticRankingDataset(torch.utils.data.IterableDataset):
    """Seeded synthetic ranking-log batches (`Batch`), reproducible per (seed, batch index).

    Args:
        profile: the feature layout (default `criteo_kaggle_profile()`).
        batch_size: samples per batch, B.
        num_batches: batches this rank yields per epoch (None: endless).
        seed: the world (entities' features, hidden weights) and the stream both follow it.
        request_spread: consecutive batches a request's samples spread over (1: one batch).
        rank, world_size: this rank takes global batches rank, rank + world_size, ...
    Iterating yields batches in order; under a DataLoader with workers, worker w of n yields
    batches w, w + n, ... `batch(i)` returns batch i directly.
    """

    def __init__(
        self,
        profile: Optional[Profile] = None,
        batch_size: int = 8192,
        num_batches: Optional[int] = None,
        seed: int = 0,
        request_spread: int = 1,
        rank: int = 0,
        world_size: int = 1,
    ):
        super().__init__()
        self.profile = profile if profile is not None else criteo_kaggle_profile()
        if not isinstance(self.profile, Profile):
            raise TypeError(f"SyntheticRankingDataset: profile must be a Profile, got {profile!r}")
        self.batch_size = _check_int(batch_size, "batch_size", 1)
        if num_batches is not None:
            num_batches = _check_int(num_batches, "num_batches", 0)
        self.num_batches = num_batches
        self.seed = _check_int(seed, "seed", 0)
        self.request_spread = _check_int(request_spread, "request_spread", 1)
        self.world_size = _check_int(world_size, "world_size", 1)
        self.rank = _check_int(rank, "rank", 0)
        if rank >= world_size:
            raise ValueError(f"SyntheticRankingDataset: rank must be < world_size={world_size}")
        p = self.profile
        self.world = World(p, self.seed)
        self._feature_std = SPARSE_STD / math.sqrt(max(len(p.features), 1))
        # Latent dense z -> observed softplus(mu + z); the label sees z through `dense_coef`.
        self._dense_mu = torch.linspace(-1.0, 2.0, p.num_dense, dtype=torch.float64)
        signs = torch.tensor([(-1.0) ** j for j in range(p.num_dense)], dtype=torch.float64)
        self._dense_coef = signs * (DENSE_STD / math.sqrt(max(p.num_dense, 1)))
        self._block_cache: Tuple[int, Optional[dict]] = (-1, None)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("SyntheticRankingDataset: endless (num_batches=None) has no len()")
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        indices = itertools.count(start, step) if self.num_batches is None else range(
            start, self.num_batches, step
        )
        for i in indices:
            yield self.batch(i)

    # ---- block plan: who is in which sample (cheap random draws for a whole block) ----------

    def _block(self, block: int) -> dict:
        if self._block_cache[0] == block:
            return self._block_cache[1]
        p = self.profile
        total = self.batch_size * self.request_spread
        g = torch.Generator().manual_seed(hashing.mix_scalar(self.seed, block, _TAG_BLOCK))
        lo, hi = p.request_size
        # Enough requests to fill the block even if every one is as small as possible.
        sizes = torch.randint(lo, hi + 1, (total // lo + 1,), generator=g)
        ends = torch.cumsum(sizes, 0)
        num_requests = int(torch.searchsorted(ends, total)) + 1
        sizes = sizes[:num_requests].clone()
        sizes[-1] -= int(ends[num_requests - 1]) - total
        users = hashing.zipf_ranks(
            torch.rand(num_requests, generator=g, dtype=torch.float64), p.num_users, p.zipf
        )
        request = torch.repeat_interleave(torch.arange(num_requests), sizes, output_size=total)
        request = request.index_select(0, torch.randperm(total, generator=g))
        user = users.index_select(0, request)
        u = torch.rand(4, total, generator=g, dtype=torch.float64)
        n_context = p.num_dense - NUM_USER_DENSE - NUM_ITEM_DENSE
        plan = {
            "request": request + block * (total + 1),
            "user": user,
            "item": self.world.draw_items(user, u[0], u[1], u[2]),
            "label_u": u[3],
            "context_z": torch.randn(total, max(n_context, 0), generator=g, dtype=torch.float64),
        }
        self._block_cache = (block, plan)
        return plan

    # ---- one batch ---------------------------------------------------------------------------

    def batch(self, index: int) -> Batch:
        """Batch number `index` of this rank: the same Batch for the same (seed, index)."""
        _check_int(index, "index", 0)
        p = self.profile
        g_index = index * self.world_size + self.rank
        block, part = divmod(g_index, self.request_spread)
        plan = self._block(block)
        sl = slice(part * self.batch_size, (part + 1) * self.batch_size)
        users, items = plan["user"][sl], plan["item"][sl]
        num = users.numel()
        world = self.world
        uniq = {
            "user": torch.unique(users, return_inverse=True),
            "item": torch.unique(items, return_inverse=True),
            "category": torch.unique(world.category_of(items), return_inverse=True),
        }
        lengths = [None] * len(p.features)
        values = [None] * len(p.features)
        logit = torch.full((num,), LABEL_BIAS, dtype=torch.float64)
        ids = {}
        for entity in ENTITIES:
            ents, inverse = uniq[entity]
            score = torch.zeros(ents.numel(), dtype=torch.float64)
            single = world.single[entity]
            if single["index"]:
                ids[entity] = world.single_bags(entity, ents)
                score += self._feature_std * world.single_weights(entity, ids[entity])
                per_sample = ids[entity].index_select(0, inverse).t()
                for j, fi in enumerate(single["index"]):
                    values[fi] = per_sample[j]
                    lengths[fi] = torch.ones(num, dtype=torch.int64)
            for fi in world.multi[entity]:
                bag_lengths, bag_values = world.multi_bags(fi, ents)
                score += self._feature_std * world.bag_weight_mean(fi, bag_lengths, bag_values)
                lengths[fi], values[fi] = _expand(bag_lengths, bag_values, inverse)
            logit += score.index_select(0, inverse)
        id_keys = self._id_keys(ids)
        if len(id_keys) == 2:  # a low-rank user x item affinity, learnable by a dot interaction
            zu = world.latent(id_keys["user"], _TAG_INTER, INTERACTION_DIM)
            zi = world.latent(id_keys["item"], _TAG_INTER + 1, INTERACTION_DIM)
            zu, zi = zu.index_select(0, uniq["user"][1]), zi.index_select(0, uniq["item"][1])
            logit += (zu * zi).sum(1) * (INTERACTION_STD / math.sqrt(INTERACTION_DIM))
        z = self._dense_latent(uniq, plan["context_z"][sl])
        logit += z @ self._dense_coef
        labels = (plan["label_u"][sl] < torch.sigmoid(logit)).to(torch.float32)
        dense = torch.nn.functional.softplus(z + self._dense_mu).to(torch.float32)
        empty = torch.zeros(0, dtype=torch.int64)
        sparse = KeyedJaggedTensor(
            keys=p.feature_names,
            values=torch.cat(values) if values else empty,
            lengths=(torch.cat(lengths) if lengths else empty).to(torch.int32),
            stride=num,
        )
        return Batch(sparse, dense, labels, plan["request"][sl])

    def _id_keys(self, ids) -> dict:
        """Keys of the first "id" feature of the user and of the item: int64 [E] each."""
        out = {}
        for entity in ("user", "item"):
            single = self.world.single[entity]
            for j, fi in enumerate(single["index"]):
                if self.profile.features[fi].role == "id":
                    out[entity] = ids[entity][:, j]
                    break
        return out

    def _dense_latent(self, uniq, context_z) -> torch.Tensor:
        """Latent z of the dense features: float64 [B, num_dense]."""
        nd = self.profile.num_dense
        n_user = min(NUM_USER_DENSE, nd)
        n_item = min(NUM_ITEM_DENSE, nd - n_user)
        parts = []
        for entity, tag, n in (("user", _TAG_DENSE, n_user), ("item", _TAG_DENSE + 1, n_item)):
            ents, inverse = uniq[entity]
            parts.append(self.world.latent(ents, tag, n).index_select(0, inverse))
        return torch.cat(parts + [context_z], 1)

    def embedding_bag_configs(self, embedding_dim: int = 64, pooling: str = "SUM") -> list:
        """TorchRec EmbeddingBagConfig tables matching this dataset's (possibly capped) profile."""
        from recxla.data.profiles import embedding_bag_configs

        return embedding_bag_configs(self.profile, embedding_dim, pooling=pooling)
