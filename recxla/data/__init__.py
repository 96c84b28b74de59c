"""Data for recxla's trainer, tests and benchmarks: synthetic ranking logs and the pipeline that
stores and serves them.

Synthetic data:
- `SyntheticRankingDataset`: seeded batches (`Batch`: a TorchRec KeyedJaggedTensor, dense
  float32 [B, 13], labels float32 [B]) built from requests (one user, several candidate items),
  Zipf-distributed users and items, and labels from a hidden logistic model.
- `criteo_kaggle_profile`: the default layout, 26 sparse features with the Criteo Kaggle table
  sizes, split into user-side and item-side features (see `recxla.data.profiles`).
- `embedding_bag_configs`: the matching TorchRec EmbeddingBagConfig tables.
- `synthetic_batches(dataset, indices, num_workers)` (recxla.data.synthetic_loader): the same
  batches made ahead by worker processes (the trainer's --loader-workers with the synthetic
  logs: a GPU rank's host thread then only launches the step).

Pipeline (files, loaders, wire format):
- `write_parquet(batches, path, sort_by=None, compression="zstd")`: Parquet with CSR (list)
  sparse columns, zstd, rows optionally sorted by an id within row groups ("auto" measures).
- `ParquetDataset(path, batch_size, rank=0, world_size=1, seed=0)`: Batches straight from Arrow
  buffers, sharded by rank, seeded order, resumable, read ahead in a background thread.
- `make_loader(path, batch_size, rank, world_size, seed, loader="local"|"ray", num_workers,
  position)`: the trainer's entry point; `iter(loader).state_dict()` is the resume position.
- `CompactBatch.encode(batch, compress=True) -> bytes` / `CompactBatch.decode(data) -> Batch`:
  one contiguous buffer per batch, for moving batches between processes or machines.
- `DataFormatError` (a ValueError): a truncated, corrupt or mismatched file or buffer.
Datasets of your own (recxla.data.schema, recxla.data.convert; docs/your-data.md):
- `read_dataset_spec(path) -> DatasetSpec`: the features, tables (rows, pooling, dim, id
  mapping), dense feature names, label and timestamp of a dataset, from its metadata.
- `load_schema(toml_path)`: the schema file that `python -m recxla.data convert` reads.
- `convert(src, out, schema=None, fmt=None)`: Parquet, CSV or Criteo TSV -> a dataset folder.
- `IdMapper.from_dataset(path).map(feature, raw_ids)`: raw ids -> rows as the conversion did.
Tables read at train time, no conversion (recxla.data.read_time; docs/your-data.md):
- `ReadTimeTable(ref, schema=None, transforms=(), joins=(), snapshots=None)`: a raw Parquet
  table or an Iceberg table ("iceberg:<catalog>#<namespace>.<table>"), feature tables joined
  ("KEY=TABLE", bucket by bucket), Python transforms ("module:function") applied, ids mapped
  as a conversion maps them; pass it where a path goes (`ParquetDataset`, `make_loader`).
- `open_table(ref)`: a table's files, row groups, schema, buckets and pinned snapshot.
- `bucket_of(ids, n)`: Iceberg's bucket transform; `write_buckets(src, key, n, out)`.
The command line: `python -m recxla.data write --out PATH --batches N [--sort-by KEY]`,
`python -m recxla.data convert SRC --out DIR [--schema FILE] [--format ...] [--transform ...]
[--join ...]`, `... info PATH`, `... bucket SRC --key COLUMN --buckets N --out DIR`.
"""

from recxla.data.buckets import bucket_of, write_buckets
from recxla.data.compact_batch import CompactBatch
from recxla.data.convert import convert
from recxla.data.errors import DataFormatError
from recxla.data.id_mapping import IdMapper
from recxla.data.loaders import LocalLoader, make_loader
from recxla.data.parquet_dataset import ParquetDataset
from recxla.data.parquet_writer import write_parquet
from recxla.data.read_time import ReadTimeTable
from recxla.data.schema import DatasetSpec, TableSpec, load_schema, read_dataset_spec
from recxla.data.table_source import open_table

# The synthetic logs and the profiles build TorchRec types: they load on first use, so that
# importing recxla.data (or one of its modules: recxla.train declares its options with
# recxla.data.epoch_plan's constants) does not import TorchRec.
_LAZY = {
    "Batch": "recxla.data.synthetic",
    "SyntheticRankingDataset": "recxla.data.synthetic",
    "CRITEO_KAGGLE_NUM_EMBEDDINGS": "recxla.data.profiles",
    "Profile": "recxla.data.profiles",
    "SparseFeature": "recxla.data.profiles",
    "criteo_kaggle_profile": "recxla.data.profiles",
    "embedding_bag_configs": "recxla.data.profiles",
}

__all__ = [
    "Batch",
    "CRITEO_KAGGLE_NUM_EMBEDDINGS",
    "CompactBatch",
    "DataFormatError",
    "DatasetSpec",
    "IdMapper",
    "LocalLoader",
    "ParquetDataset",
    "Profile",
    "ReadTimeTable",
    "SparseFeature",
    "SyntheticRankingDataset",
    "TableSpec",
    "bucket_of",
    "convert",
    "criteo_kaggle_profile",
    "embedding_bag_configs",
    "load_schema",
    "make_loader",
    "open_table",
    "read_dataset_spec",
    "write_buckets",
    "write_parquet",
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'recxla.data' has no attribute {name!r}")
