"""What one training example asks of the machine: pooled embedding columns, ids, dense FLOPs.

`Workload` holds per-example figures; `Workload.measure` takes them from real batches of a
`recxla.data` profile with the same counter the sharding planner uses
(`recxla.planner.TableLoads`), so key skew and dedup at the chosen batch size are measured,
not assumed. Dense FLOPs follow from the MLP sizes (`dlrm_dense_flops`).
"""

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple

from recxla.formats import row_bytes
from recxla.torchrec import id_wire_format as wire

# TorchRec's DLRM example for Criteo (torchrec/examples/dlrm): dense arch 512-256-D,
# over arch 512-512-256-1.
DLRM_DENSE_ARCH = (512, 256)
DLRM_OVER_ARCH = (512, 512, 256, 1)


@dataclass(frozen=True)
class Workload:
    """Per-example load of a recommendation model.

    name: label.
    dims: embedding dimension of every pooled feature (one pooled row each per example).
    ids_per_example: id occurrences per example, all features.
    unique_per_example: ids per example left after dedup per (table, destination rank) at the
        batch size modeled.
    dense_flops_per_example: forward FLOPs of the dense layers (training does 3x).
    dense_param_bytes: bytes of the dense parameters (fp32), all-reduced every step.
    table_bytes: bytes of all embedding tables (fp32), for weight averaging in 2D.
    """

    name: str
    dims: Tuple[int, ...]
    ids_per_example: float
    unique_per_example: float
    dense_flops_per_example: float
    dense_param_bytes: float
    table_bytes: float

    def __post_init__(self):
        if not self.dims or min(self.dims) < 1:
            raise ValueError(f"recxla.sim.Workload {self.name}: dims must be ints >= 1")
        for field in ("ids_per_example", "unique_per_example", "dense_flops_per_example",
                      "dense_param_bytes", "table_bytes"):
            if getattr(self, field) < 0:
                raise ValueError(f"recxla.sim.Workload {self.name}: {field} must be >= 0")
        if self.unique_per_example > self.ids_per_example:
            raise ValueError(f"recxla.sim.Workload {self.name}: unique_per_example must be <= "
                             "ids_per_example")

    def pooled_bytes(self, fmt: str) -> float:
        """Bytes of one example's pooled rows on the wire in `fmt` (FP8: codes + row scale)."""
        return float(sum(row_bytes(d, fmt) for d in self.dims))

    @property
    def id_bytes(self) -> float:
        """Bytes of one example's input all-to-all entries as recxla's module sends them
        (recxla.planner.loads): int32 unique ids plus a 2-byte inverse index per id, or the
        raw int32 ids where that is smaller, and one int32 length per feature
        (recxla.torchrec.id_wire_format)."""
        ids = wire.encoded_ids_bytes(self.ids_per_example, self.unique_per_example, 4, index=2)
        return ids + len(self.dims) * wire.LENGTH_BYTES

    @property
    def lookup_bytes(self) -> float:
        """fp32 bytes an example's lookup streams: its unique rows gathered, then every id's
        row added into its bag."""
        mean_dim = sum(self.dims) / len(self.dims)
        return (self.unique_per_example + self.ids_per_example) * mean_dim * 4

    def with_dims(self, dim: int) -> "Workload":
        """The same workload with every embedding dimension set to `dim` (tables scale too)."""
        old = sum(self.dims) / len(self.dims)
        return replace(self, name=f"{self.name}-d{dim}", dims=(dim,) * len(self.dims),
                       table_bytes=self.table_bytes * dim / old)

    @classmethod
    def measure(cls, profile=None, dim: int = 64, batch_size: int = 8192,
                sample_batches: int = 2, seed: int = 0, name: Optional[str] = None,
                dense_arch: Sequence[int] = DLRM_DENSE_ARCH,
                over_arch: Sequence[int] = DLRM_OVER_ARCH) -> "Workload":
        """A DLRM on a `recxla.data` profile (default Criteo Kaggle), counted on real batches.

        unique_per_example is the ids left after dedup per table in a batch of `batch_size`
        (a table-wise shard's dedup: the most a rank's batch can share).
        """
        from recxla.data import SyntheticRankingDataset, criteo_kaggle_profile
        from recxla.data import embedding_bag_configs
        from recxla.planner import TableLoads

        profile = profile or criteo_kaggle_profile()
        tables = embedding_bag_configs(profile, dim)
        data = SyntheticRankingDataset(profile, batch_size=batch_size, seed=seed)
        loads = TableLoads.measure(tables, [data.batch(i) for i in range(sample_batches)], 1)
        unique = float(loads.cum_unique[:, -1].sum()) / loads.batch_size
        ids = float(loads.cum_occurrences[:, -1].sum()) / loads.batch_size
        flops, params = dlrm_dense_flops(profile.num_dense, len(tables), dim, dense_arch,
                                         over_arch)
        return cls(
            name=name or f"{profile.name}-dlrm-d{dim}",
            dims=(dim,) * len(tables),
            ids_per_example=ids,
            unique_per_example=unique,
            dense_flops_per_example=flops,
            dense_param_bytes=params * 4,
            table_bytes=sum(t.num_embeddings for t in tables) * dim * 4,
        )


def dlrm_dense_flops(num_dense: int, num_sparse: int, dim: int,
                     dense_arch: Sequence[int] = DLRM_DENSE_ARCH,
                     over_arch: Sequence[int] = DLRM_OVER_ARCH) -> Tuple[float, int]:
    """(forward FLOPs per example, parameters) of a DLRM: dense MLP num_dense -> dense_arch
    -> dim, pairwise dot interaction of the num_sparse + 1 vectors, over MLP."""
    bottom = [num_dense, *dense_arch, dim]
    pairs = (num_sparse + 1) * num_sparse // 2
    top = [dim + pairs, *over_arch]
    weights = sum(a * b for a, b in zip(bottom, bottom[1:])) + sum(
        a * b for a, b in zip(top, top[1:]))
    biases = sum(bottom[1:]) + sum(top[1:])
    flops = 2.0 * weights + 2.0 * pairs * dim
    return flops, weights + biases
