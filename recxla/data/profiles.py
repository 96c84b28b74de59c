"""Shapes of synthetic ranking logs: which sparse features exist, how large their tables are,
which side of a request (user or item) each belongs to, how many ids a bag holds.

The default profile is the Criteo Kaggle (Display Advertising Challenge) layout: 13 dense
features and 26 categorical features with the table sizes that TorchRec's DLRM example and the
DLRM repository use for that dataset (33,762,577 rows in all). Criteo's features are anonymized,
so the user/item split below is ours; it follows what a ranking log of that size holds:

    user side: the same bag in every sample of a request (13 features)
        cat_2   10,131,227  user id
        cat_11   8,351,593  history: items the user interacted with, multi-hot (10-100)
        cat_3    2,202,608  user attribute (e.g. a device or location id)
        cat_6       12,517  user attribute
        cat_4  305   cat_5  24   cat_8  3   cat_13  27   cat_16  10   cat_19  4
        cat_21  18   cat_22  15  cat_24  105             user attributes (demographics, ...)
    item side: varies across the candidates of a request (13 features)
        cat_20   7,046,547  item id
        cat_15   5,461,306  item attribute (e.g. creative id)
        cat_23     286,181  item tags, multi-hot (1-5)
        cat_25  142,572  cat_9  93,145  cat_14  14,992  cat_10  5,683  cat_17  5,652
                                                      item attributes
        cat_0  1,460  cat_1  583  cat_7  633  cat_12  3,194  cat_18  2,173
                                                      attributes of the item's category
                                                      (category, brand, advertiser, ...)

Items belong to `num_categories` categories. A user has a few interest categories, and a share
of the candidates of each request (and of the user's history) comes from them, as candidates
retrieved for a user do; so category-level keys also repeat inside a request, while item ids
vary. Categories, items within a category, users and attribute values all follow Zipf laws
with the profile's exponent (0 = uniform).

`capped(max_rows)` shrinks every table to at most `max_rows` rows (ids wrap around, like the
hashing trick) so that the embedding tables fit a small machine; the populations of users and
items and their skew stay the same.
"""

from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

# Criteo Kaggle categorical cardinalities, cat_0 .. cat_25 (torchrec/examples/dlrm: "Kaggle").
CRITEO_KAGGLE_NUM_EMBEDDINGS: Tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
NUM_DENSE = 13
ROLES = ("id", "attribute", "history", "category")
SIDES = ("user", "item")


@dataclass(frozen=True)
class SparseFeature:
    """One categorical feature, one embedding table.

    name: KJT key and table name. num_embeddings: rows of its table.
    side: "user" (a function of the request's user) or "item" (of the candidate item).
    role: "id": the entity's own id, one per bag.
          "attribute": ids drawn once per entity from a Zipf law over the table.
          "history": (user side) ids of items the user interacted with.
          "category": (item side) ids drawn once per category of items, shared by its items.
    pooling: (min, max) bag length, drawn once per entity, so a user's bag is the same in every
        sample of that user.
    """

    name: str
    num_embeddings: int
    side: str
    role: str = "attribute"
    pooling: Tuple[int, int] = (1, 1)

    def __post_init__(self):
        where = f"SparseFeature {self.name}"
        if self.side not in SIDES:
            raise ValueError(f"{where}: side must be one of {SIDES}, got {self.side!r}")
        if self.role not in ROLES:
            raise ValueError(f"{where}: role must be one of {ROLES}, got {self.role!r}")
        if self.role == "history" and self.side != "user":
            raise ValueError(f"{where}: a history feature must be user-side")
        if self.role == "category" and self.side != "item":
            raise ValueError(f"{where}: a category feature must be item-side")
        if not isinstance(self.num_embeddings, int) or self.num_embeddings < 1:
            raise ValueError(f"{where}: num_embeddings must be an int >= 1")
        lo, hi = self.pooling
        if not 0 <= lo <= hi:
            raise ValueError(f"{where}: pooling must be (min, max) with 0 <= min <= max")
        if self.role == "id" and tuple(self.pooling) != (1, 1):
            raise ValueError(f"{where}: an id feature has pooling (1, 1)")

    @property
    def entity(self) -> str:
        """What the bag is a function of: "user", "item" or "category"."""
        return "category" if self.role == "category" else self.side


@dataclass(frozen=True)
class Profile:
    """The shape of a synthetic ranking log.

    features: the sparse features in KJT key order.
    num_users / num_items / num_categories: population sizes.
    zipf: Zipf exponent of users, categories, items in a category and attribute values
        (0.0 = uniform).
    request_size: (min, max) candidates per request, uniform in between.
    interests: interest categories per user; interest_share: the share of candidates and
        history items drawn from them (the rest from the global category law).
    """

    name: str
    features: Tuple[SparseFeature, ...]
    num_users: int
    num_items: int
    num_categories: int = 1460
    zipf: float = 1.05
    request_size: Tuple[int, int] = (4, 28)
    interests: int = 4
    interest_share: float = 0.5
    num_dense: int = NUM_DENSE

    def __post_init__(self):
        where = f"Profile {self.name}"
        names = [f.name for f in self.features]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: feature names must be unique")
        if min(self.num_users, self.num_items, self.num_categories) < 1:
            raise ValueError(f"{where}: num_users, num_items, num_categories must be >= 1")
        if self.num_categories > self.num_items:
            raise ValueError(f"{where}: num_categories must be <= num_items")
        if not self.zipf >= 0.0:
            raise ValueError(f"{where}: zipf must be >= 0, got {self.zipf}")
        lo, hi = self.request_size
        if not 1 <= lo <= hi:
            raise ValueError(f"{where}: request_size must be (min, max) with 1 <= min <= max")
        if self.interests < 1 or not 0.0 <= self.interest_share <= 1.0:
            raise ValueError(f"{where}: interests must be >= 1, interest_share in [0, 1]")
        if self.num_dense < 0:
            raise ValueError(f"{where}: num_dense must be >= 0")

    @property
    def feature_names(self) -> List[str]:
        return [f.name for f in self.features]

    @property
    def num_embeddings(self) -> List[int]:
        return [f.num_embeddings for f in self.features]

    def side_of(self, side: str) -> List[str]:
        """Names of the features of one side ("user" or "item")."""
        return [f.name for f in self.features if f.side == side]

    def capped(self, max_rows: Optional[int]) -> "Profile":
        """The same profile with every table cut to at most `max_rows` rows (None: unchanged)."""
        if max_rows is None:
            return self
        if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1:
            raise ValueError(f"Profile.capped: max_rows must be an int >= 1, got {max_rows!r}")
        feats = [replace(f, num_embeddings=min(f.num_embeddings, max_rows)) for f in self.features]
        return replace(self, features=tuple(feats))

    def with_zipf(self, exponent: float) -> "Profile":
        """The same profile with another Zipf exponent (0.0 = uniform)."""
        return replace(self, zipf=float(exponent))


# Roles of the user-side Criteo features and of the item-side ones that are not attributes.
_CRITEO_ROLES = {2: ("user", "id"), 11: ("user", "history"), 20: ("item", "id")}
_CRITEO_USER_ATTRIBUTES = (3, 6, 4, 5, 8, 13, 16, 19, 21, 22, 24)
_CRITEO_CATEGORY_ATTRIBUTES = (0, 1, 7, 12, 18)
_CRITEO_ITEM_TAGS = 23


def criteo_kaggle_profile(
    zipf: float = 1.05,
    history_pooling: Tuple[int, int] = (10, 100),
    tags_pooling: Tuple[int, int] = (1, 5),
    request_size: Tuple[int, int] = (4, 28),
    interest_share: float = 0.5,
    max_rows: Optional[int] = None,
) -> Profile:
    """The default profile: Criteo Kaggle table sizes, with request structure.

    Args:
        zipf: Zipf exponent of users, categories, items and attribute values (0.0: uniform).
        history_pooling: (min, max) length of the user history bag (cat_11). The default
            mean, 55, is of the order of the pooled history features of production models
            (MLPerf's multi-hot Criteo layout pools up to 100 ids a feature).
        tags_pooling: (min, max) length of the item tags bag (cat_23).
        request_size: (min, max) candidate items per request.
        interest_share: share of candidates and history items from the user's interests.
        max_rows: cap on table rows (None: the full 33.8M rows).
    """
    feats = []
    for i, rows in enumerate(CRITEO_KAGGLE_NUM_EMBEDDINGS):
        name = f"cat_{i}"
        if i in _CRITEO_ROLES:
            side, role = _CRITEO_ROLES[i]
        elif i in _CRITEO_USER_ATTRIBUTES:
            side, role = "user", "attribute"
        elif i in _CRITEO_CATEGORY_ATTRIBUTES:
            side, role = "item", "category"
        else:
            side, role = "item", "attribute"
        pooling = (1, 1)
        if role == "history":
            pooling = tuple(history_pooling)
        elif i == _CRITEO_ITEM_TAGS:
            pooling = tuple(tags_pooling)
        feats.append(SparseFeature(name, rows, side, role, pooling))
    profile = Profile(
        name="criteo_kaggle",
        features=tuple(feats),
        num_users=CRITEO_KAGGLE_NUM_EMBEDDINGS[2],
        num_items=CRITEO_KAGGLE_NUM_EMBEDDINGS[20],
        num_categories=CRITEO_KAGGLE_NUM_EMBEDDINGS[0],
        zipf=float(zipf),
        request_size=tuple(request_size),
        interest_share=float(interest_share),
    )
    return profile.capped(max_rows)


def embedding_bag_configs(
    profile: Optional[Profile] = None,
    embedding_dim: int = 64,
    max_rows: Optional[int] = None,
    pooling: str = "SUM",
) -> list:
    """TorchRec EmbeddingBagConfig tables for `profile`, one table per feature.

    Args:
        profile: default `criteo_kaggle_profile()`.
        embedding_dim: columns of every table.
        max_rows: cap on rows per table; generate the data from `profile.capped(max_rows)` too,
            or ids of the big tables fall outside the capped rows.
        pooling: "SUM" or "MEAN".
    Returns:
        list of torchrec EmbeddingBagConfig named `t_<feature>`, feature_names [<feature>].
    """
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    op = "recxla.data.embedding_bag_configs"
    if not isinstance(embedding_dim, int) or isinstance(embedding_dim, bool) or embedding_dim < 1:
        raise ValueError(f"{op}: embedding_dim must be an int >= 1, got {embedding_dim!r}")
    if pooling not in ("SUM", "MEAN"):
        raise ValueError(f"{op}: pooling must be 'SUM' or 'MEAN', got {pooling!r}")
    if profile is not None and not isinstance(profile, Profile):
        raise TypeError(f"{op}: profile must be a Profile, got {type(profile).__name__}")
    profile = (profile or criteo_kaggle_profile()).capped(max_rows)
    return [
        EmbeddingBagConfig(
            num_embeddings=f.num_embeddings,
            embedding_dim=embedding_dim,
            name=f"t_{f.name}",
            feature_names=[f.name],
            pooling=PoolingType[pooling],
        )
        for f in profile.features
    ]
