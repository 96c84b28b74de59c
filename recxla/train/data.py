"""The trainer's data: this rank's shard of the synthetic ranking logs, or of a Parquet dataset
(--data), as TorchRec batches, and the tables of the model that reads them.

The model (`TrainData.tables`, `num_dense`, `weighted`):
- --data alone: the dataset's own (`recxla.data.read_dataset_spec`): one table per sparse
  feature, or per group of features that share one, with the dataset's rows, pooling and
  per-id weights; one embedding dim for all (DLRM's interaction needs it): --embedding-dim,
  else the dim the dataset names, else 64; --table-rows overrides rows; the dense width is the
  dataset's.
- synthetic logs, or --data with --profile/--max-rows: the profile's tables (`t_cat_<i>`
  reading `cat_<i>`, 13 dense features); files must then hold those features with ids below
  the tables' rows (`check_tables` names what does not fit).

Batches: synthetic step k of this rank trains on batch k mod `train_batches` of its shard of
`recxla.data.SyntheticRankingDataset` (rank r of W takes global batches r, r + W, ...). With
--data they come from `recxla.data.make_loader`, endless: an epoch is one pass over this rank's
share of the training row groups, a new seeded order every epoch. Either way the data position
is the step count alone, so a resumed run sees exactly the batches an uninterrupted one would.

Held-out batches (AUC and log loss): --eval-data; else with --eval-fraction (default with the
dataset's model) the row groups `split_row_groups` holds out of --data, never trained on; else
the synthetic held-out split (batches at indices training never reaches: SYNTHETIC_HELD_OUT
examples of the job in whole batches per rank, or --eval-batches batches per rank). Each rank
evaluates all of its share (every rank reads as many batches), or its first --eval-batches.
"""

import dataclasses
import os
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from torchrec.datasets.utils import Batch as TorchRecBatch

from recxla.data import Profile, SyntheticRankingDataset, criteo_kaggle_profile
from recxla.train.config import (FALLBACK_EMBEDDING_DIM, HISTORY_LENGTHS, SYNTHETIC_HELD_OUT,
                                 TrainConfig)

# First batch index of the held-out split: training never reaches it (2**40 batches of even
# one sample per rank is far beyond any run).
HELD_OUT_START = 1 << 40
TIMESTAMP_COLUMN = "timestamp"


def make_profile(config: TrainConfig) -> Profile:
    """The table profile of the run: Criteo Kaggle's 26 tables capped at --max-rows rows
    ("small": also short history bags; --model history: the histories a sequence model
    reads, HISTORY_LENGTHS)."""
    history = (2, 10) if config.profile == "small" else (10, 100)
    if config.model == "history":
        history = HISTORY_LENGTHS[config.profile]
    return criteo_kaggle_profile(zipf=config.zipf, history_pooling=history,
                                 max_rows=config.max_rows)


def to_torchrec(batch) -> TorchRecBatch:
    """recxla.data.Batch -> torchrec.datasets.utils.Batch (what TorchRec's pipelines move and
    DLRMTrain reads): dense_features float32 [B, num_dense], sparse_features KJT, labels
    float32 [B]."""
    return TorchRecBatch(dense_features=batch.dense, sparse_features=batch.sparse,
                         labels=batch.labels)


def embedding_dim_of(spec, given: Optional[int]) -> int:
    """The model's one embedding dim: `given` (--embedding-dim), else the dim the dataset's
    tables name, else FALLBACK_EMBEDDING_DIM. ValueError when the tables name several."""
    if given is not None:
        return given
    dims = sorted({t.embedding_dim for t in spec.tables if t.embedding_dim is not None})
    if len(dims) > 1:
        named = {t.name: t.embedding_dim for t in spec.tables if t.embedding_dim is not None}
        raise ValueError(f"the dataset's tables name several embedding dims {named}; DLRM's "
                         "interaction needs one for all tables: pass --embedding-dim")
    return dims[0] if dims else FALLBACK_EMBEDDING_DIM


def model_table_name(name: str) -> str:
    """The model's name of a dataset's table: its own, unless torch's ModuleDict of the
    EmbeddingBagCollection cannot hold it (an attribute such as "items" or "keys", or a dot),
    then with "_table" appended."""
    import torch

    if name and "." not in name and not hasattr(torch.nn.ModuleDict(), name):
        return name
    return f"{name.replace('.', '_')}_table"


def dataset_tables(spec, embedding_dim: int, table_rows: Sequence[Tuple[str, int]] = ()):
    """TorchRec EmbeddingBagConfigs of a DatasetSpec: one per TableSpec (named by
    `model_table_name`), its features, rows (or `table_rows`' override, by the model's name)
    and pooling, `embedding_dim` columns."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    names = [model_table_name(t.name) for t in spec.tables]
    if len(set(names)) != len(names):
        raise ValueError(f"the dataset's tables {[t.name for t in spec.tables]} give the "
                         f"model's tables {names}: rename one in the schema")
    rows = dict(table_rows)
    unknown = sorted(set(rows) - set(names))
    if unknown:
        raise ValueError(f"--table-rows: unknown table(s) {unknown}; the dataset's tables: "
                         f"{names}")
    return [EmbeddingBagConfig(
        name=name, embedding_dim=embedding_dim, num_embeddings=rows.get(name, t.num_rows),
        feature_names=list(t.features),
        pooling=PoolingType.MEAN if t.pooling == "mean" else PoolingType.SUM)
        for name, t in zip(names, spec.tables)]


def split_row_groups(info, fraction: float, world_size: int,
                     timestamp: Optional[str]) -> Tuple[List[int], List[int]]:
    """(training, held-out) row group indices of a dataset (DatasetInfo): the held-out ones are
    the latest by their largest timestamp (Parquet statistics of the timestamp column) when the
    dataset has one, else the last in file order, as many as hold `fraction` of the rows and
    at least one per rank. ValueError when either side would have fewer groups than ranks."""
    n = len(info.row_groups)
    order = list(range(n))
    if timestamp is not None:
        order.sort(key=lambda i: (_largest_timestamp(info, i), i))
    held, rows = [], 0
    while order and (rows < fraction * info.num_rows or len(held) < world_size):
        i = order.pop()
        held.append(i)
        rows += info.row_groups[i][2]
    if len(order) < world_size:
        raise ValueError(
            f"{info.path}: {info.num_rows} rows in {n} row groups: holding out {fraction} of "
            f"the rows ({len(held)} row groups, at least one per rank) leaves {len(order)} for "
            f"training on {world_size} ranks. Row groups are what the ranks share out, and "
            f"both splits need one per rank: {_fewer_rows_per_group(info, fraction, world_size)}"
            + ("" if n < 2 * world_size else "; or lower --eval-fraction")
            + "; or give held-out files of their own with --eval-data")
    return sorted(order), sorted(held)


def _fewer_rows_per_group(info, fraction: float, world_size: int) -> str:
    """The advice for a dataset whose row groups are too few to split: convert it again with
    row groups small enough for one per rank on both sides of the split."""
    rows = max(1, int(min(fraction, 1 - fraction) * info.num_rows) // world_size)
    if hasattr(info, "largest_timestamp"):  # a raw table: its own files' row groups
        return (f"write the table with row groups of {rows} rows or fewer (`python -m "
                f"recxla.data bucket ... --rows-per-group {rows}`; an Iceberg table's property "
                f"write.parquet.row-group-limit), or convert it (`python -m recxla.data convert "
                f"... --rows-per-group {rows}`)")
    return (f"convert the click log again with smaller row groups, `python -m recxla.data "
            f"convert SRC --out DIR --rows-per-group {rows}` or fewer (with the first "
            "conversion's other options)")


def _largest_timestamp(info, group: int) -> int:
    import pyarrow.parquet as pq

    if hasattr(info, "largest_timestamp"):  # a table read at train time: from its planning
        return info.largest_timestamp(group)

    fi, gi, _ = info.row_groups[group]
    md = pq.ParquetFile(info.files[fi].path).metadata
    names = md.schema.names
    if TIMESTAMP_COLUMN not in names:
        return 0
    stats = md.row_group(gi).column(names.index(TIMESTAMP_COLUMN)).statistics
    return stats.max if stats is not None and stats.has_min_max else 0


def is_raw_table(config: TrainConfig) -> bool:
    """--data is read as a raw table (recxla.data.read_time): an Iceberg reference, --schema,
    --transform or --join given, or Parquet files not in recxla's layout."""
    from recxla.data.parquet_layout import is_recxla_layout
    from recxla.data.table_source import is_table_ref

    if config.data is None:
        return False
    if config.schema is not None or config.transform or config.join or \
            is_table_ref(config.data):
        return True
    # A missing path is reported by the reader of converted datasets, as it always was.
    return os.path.exists(config.data) and not is_recxla_layout(config.data)


# The last raw table planned in this process: the preflight, the resume check and the run
# open the same table at the same snapshots, and its planning pass reads the whole table.
_PLANNED: dict = {}


def open_raw_table(config: TrainConfig, snapshots: Optional[Sequence[Optional[int]]] = None):
    """The --data raw table with its --schema, --join and --transform, planned
    (recxla.data.read_time.ReadTimeTable); `snapshots` pins its Iceberg tables (None: the
    current ones)."""
    from recxla.data.read_time import ReadTimeTable

    if config.max_rows is not None:
        raise ValueError(f"{config.data}: a raw table gives its own model (tables from its "
                         "columns); --profile/--max-rows apply to converted datasets")
    if snapshots is None:
        snapshots = current_snapshots(config)
    key = _raw_table_key(config, snapshots)
    if key not in _PLANNED:
        _PLANNED.clear()
        _PLANNED[key] = ReadTimeTable(config.data, config.schema, config.transform,
                                      config.join, snapshots)
    return _PLANNED[key]


def _raw_table_key(config: TrainConfig, snapshots: Sequence[Optional[int]]) -> tuple:
    """What a raw table's plan depends on, cheap to get (footers, the transforms' sources):
    the options, and each table's fingerprint at its snapshot."""
    from recxla.data.joins import parse_join
    from recxla.data.table_source import open_table
    from recxla.data.transforms import identity, load_transforms

    refs = [config.data] + [parse_join(j)[1] for j in config.join]
    tables = tuple(open_table(r, s).fingerprint for r, s in zip(refs, snapshots))
    return (config.data, config.schema, config.join, tuple(snapshots), tables,
            tuple(identity(load_transforms(config.transform))))


def current_snapshots(config: TrainConfig) -> Optional[List[Optional[int]]]:
    """The snapshots a raw --data table and its joins read now (None for other data): what
    rank 0 pins for the whole job."""
    from recxla.data.joins import parse_join
    from recxla.data.table_source import open_table

    if not is_raw_table(config):
        return None
    refs = [config.data] + [parse_join(j)[1] for j in config.join]
    return [open_table(r).snapshot for r in refs]


def data_fingerprint(config: TrainConfig,
                     snapshots: Optional[Sequence[Optional[int]]] = None) -> Optional[str]:
    """The training data's fingerprint (a converted dataset's files and row groups, from the
    footers; a raw table's source, snapshots, joins, transforms and plan), None without
    --data: a checkpoint records it, so that --resume on other data fails."""
    if config.data is None:
        return None
    if is_raw_table(config):
        return _flagged("--data", open_raw_table, config, snapshots).info.fingerprint
    from recxla.data.parquet_layout import DatasetInfo

    return DatasetInfo(config.data, "--data").fingerprint


class TrainData:
    """This rank's training and held-out batches, and the model's tables.

    Args:
        config: batch size, seed, profile or dataset, train/eval batch counts, the loader.
        rank, world_size: this rank's shard.
        snapshots: the Iceberg snapshots a raw --data table and its joins read (the job's
            pinned ones: rank 0's at start, or the checkpoint's on resume); None: current.
    Raises (with --data or --eval-data) FileNotFoundError or ValueError (DataFormatError)
    starting with the option's flag and naming the files.
    """

    def __init__(self, config: TrainConfig, rank: int, world_size: int,
                 snapshots: Optional[Sequence[Optional[int]]] = None):
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.spec = self.profile = self.dataset = self.raw = None
        self._table_dims: Optional[Dict[str, int]] = None
        self.wire = None  # --embedding-dims auto: each table's bytes (TableWire)
        # What the loaders read: the --data path, or the raw table (joins, transforms).
        self.source = config.data
        if config.data is not None and _flagged("--data", is_raw_table, config):
            self.raw = _flagged("--data", open_raw_table, config, snapshots)
            self.source = self.raw
        self._loader = self._iter = None
        self.files = self.eval_files = None
        self.train_groups: Optional[List[int]] = None
        self.eval_groups: Optional[List[int]] = None
        self._split_info = None  # what --eval-fraction split (DatasetInfo or ReadTimeInfo)
        if config.model_from_data:
            from recxla.data import read_dataset_spec

            self.spec = self.raw.spec if self.raw is not None else _flagged(
                "--data", read_dataset_spec, config.data)
            if self.spec.label_kind != "binary":
                raise ValueError(f"--data: {config.data}: the label {self.spec.label!r} is a "
                                 "float target; the trainer trains a click task (0/1 labels, "
                                 "BCE loss, AUC)")
            self.embedding_dim = _flagged("--data", embedding_dim_of, self.spec,
                                          config.embedding_dim)
            self.num_dense = len(self.spec.dense_features)
            self.weighted = any(t.weighted for t in self.spec.tables)
        else:
            self.profile = make_profile(config)
            self.dataset = SyntheticRankingDataset(
                self.profile, batch_size=config.batch_size, seed=config.seed, rank=rank,
                world_size=world_size)
            self.embedding_dim = config.embedding_dim
            self.num_dense = self.profile.num_dense
            self.weighted = False
        tables = _flagged("--table-rows", self.tables, 1)  # names and rows: any dim will do
        if config.data is not None:
            if config.eval_fraction is not None:
                from recxla.data.parquet_layout import DatasetInfo

                info = self.raw.info if self.raw is not None else _flagged(
                    "--data", DatasetInfo, config.data)
                self.train_groups, self.eval_groups = _flagged(
                    "--eval-fraction", split_row_groups, info, config.eval_fraction,
                    world_size, self.spec.timestamp if self.spec else None)
                self._split_info = info
            self.files = self._open("--data", self.source, tables, num_epochs=None,
                                    row_groups=self.train_groups,
                                    shuffle_rows=config.shuffle_rows)
            if self.eval_groups is not None:
                self.eval_files = self._open("--eval-fraction", self.source, tables,
                                             row_groups=self.eval_groups, shuffle=False,
                                             num_epochs=1, prefetch=0)
        if config.eval_data is not None:
            self.eval_files = self._open("--eval-data", config.eval_data, tables, shuffle=False,
                                         num_epochs=1, prefetch=0)

    def _open(self, flag: str, path, tables, **kwargs):
        """`recxla.data.ParquetDataset` of `path` (or the raw table) for this rank (footers
        only), checked against the model's tables and dense width."""
        from recxla.data import ParquetDataset

        files = _flagged(flag, ParquetDataset, path, self.config.batch_size, self.rank,
                         self.world_size, self.config.seed, **kwargs)
        try:
            files.check_tables(tables, self.num_dense)
        except ValueError as e:
            hint = "" if self.spec is not None else (
                f"; the model's tables are --profile {self.config.profile} capped at --max-rows "
                f"{self.config.max_rows} (`python -m recxla.data write --max-rows "
                f"{self.config.max_rows}` writes files that fit; without --profile and "
                "--max-rows the model is the dataset's)")
            raise type(e)(f"{flag}: {e}{hint}") from None
        return files

    def tables(self, embedding_dim: Optional[int] = None) -> list:
        """TorchRec EmbeddingBagConfigs of the model: `embedding_dim` columns each, or by
        default the run's dims (--embedding-dim, per table --embedding-dims)."""
        dim = self.embedding_dim if embedding_dim is None else embedding_dim
        if self.spec is not None:
            tables = dataset_tables(self.spec, dim, self.config.table_rows)
        else:
            tables = self.dataset.embedding_bag_configs(dim)
        if embedding_dim is None and self.config.embedding_dims:
            dims = self.table_dims(tables)
            tables = [dataclasses.replace(t, embedding_dim=dims.get(t.name, t.embedding_dim))
                      for t in tables]
        return tables

    def history_features(self) -> Tuple[str, str]:
        """--model history: (the history feature, the candidate item's id feature): the
        synthetic profile's "history" and item-side "id" roles, or the dataset's one history
        (a schema's `history_of`, DatasetSpec.histories). ValueError when a dataset names no
        history or several."""
        if self.profile is not None:
            history = [f.name for f in self.profile.features if f.role == "history"]
            candidate = [f.name for f in self.profile.features
                         if f.role == "id" and f.side == "item"]
            return history[0], candidate[0]
        histories = self.spec.histories
        if len(histories) != 1:
            named = "names none" if not histories else f"names {len(histories)}: {histories}"
            raise ValueError(
                f"--model history: reads one user history; --data {self.config.data} {named} "
                "(mark the list column of a user's items with history_of = \"<the item's "
                "feature>\" in its [sparse.<feature>] of --schema; docs/your-data.md)")
        return histories[0]

    def table_dims(self, tables) -> Dict[str, int]:
        """{table: dim} of --embedding-dims over `tables` (at the run's one dim): the named
        ones, or with auto the proposal of recxla.planner.embedding_dims on every rank's first
        batch (the same on every rank), kept in `wire` with its bytes."""
        if self._table_dims is not None:
            return self._table_dims
        spec = self.config.embedding_dims
        names = [t.name for t in tables]
        if spec[0] != "auto":
            unknown = sorted(set(n for n, _ in spec) - set(names))
            if unknown:
                raise ValueError(f"--embedding-dims: unknown table(s) {unknown}; the model's "
                                 f"tables: {names}")
            above = {n: d for n, d in spec if d > self.embedding_dim}
            if above:
                raise ValueError(f"--embedding-dims: {above} above the run's dim "
                                 f"{self.embedding_dim} (--embedding-dim): DLRM's interaction "
                                 "takes every table at that dim, smaller ones padded to it")
            self._table_dims = dict(spec)
        elif self.world_size < 2:
            self._table_dims = {}  # one rank: nothing crosses a wire
        else:
            from recxla.planner.embedding_dims import propose_dims, table_wire_bytes

            batches = [self.rank_sample(r).sparse_features for r in range(self.world_size)]
            fwd, bwd = self.config.comms
            self.wire = table_wire_bytes(tables, batches, fwd, bwd)
            self._table_dims = propose_dims(self.wire, spec[1], fwd_comm=fwd, bwd_comm=bwd)
        return self._table_dims

    @property
    def fingerprint(self) -> Optional[str]:
        """The training data's fingerprint (`data_fingerprint`), None for synthetic logs: a
        checkpoint records it so that --resume on other data fails instead of reading another
        sequence."""
        return None if self.files is None else self.files.identity["dataset"]

    @property
    def snapshots(self) -> Optional[List[Optional[int]]]:
        """The Iceberg snapshots read (a raw table's, then its joins'), for the checkpoint."""
        return None if self.raw is None else self.raw.snapshots

    def sample(self) -> TorchRecBatch:
        """Rank 0's first training batch, the same on every rank (row exchange is judged on
        it), read in this process."""
        return self.rank_sample(0)

    def rank_sample(self, rank: int) -> TorchRecBatch:
        """Rank `rank`'s first training batch, read in this process (any rank can read it)."""
        if self.files is None:
            return to_torchrec(SyntheticRankingDataset(
                self.profile, batch_size=self.config.batch_size, seed=self.config.seed,
                rank=rank, world_size=self.world_size).batch(0))
        from recxla.data import ParquetDataset

        first = ParquetDataset(self.source, self.config.batch_size, rank, self.world_size,
                               self.config.seed, prefetch=0, row_groups=self.train_groups,
                               shuffle_rows=self.config.shuffle_rows)
        it = iter(first)
        try:
            return to_torchrec(next(it))
        finally:
            it.close()

    def train(self, start_step: int, end_step: int) -> Iterator[TorchRecBatch]:
        """The batches of steps start_step .. end_step - 1, in order.

        With --data the loader starts at the position after `start_step` batches. The step
        count is the position, not the iterator's `state_dict()` saved at a checkpoint: the
        pipeline pulls batches ahead of the step it trains (the next batch's input dist runs
        during this step), so the iterator is past the steps done by the pipeline's depth,
        while steps done is exactly the batches trained on. Every rank yields as many batches
        per epoch (ParquetDataset's sharding), so the steps map to one position, the same on
        every rank, and a checkpoint's fingerprint check (checkpoint.check_compatible) makes
        sure it is a position in the same files.
        """
        self.close()
        if self.files is None:
            from recxla.data.synthetic_loader import synthetic_batches

            it = self._iter = synthetic_batches(
                self.dataset, [step % self.config.train_batches
                               for step in range(start_step, end_step)],
                self.config.loader_workers)
            return (to_torchrec(batch) for batch in it)
        from recxla.data import make_loader

        self._loader = make_loader(
            self.source, self.config.batch_size, self.rank, self.world_size,
            self.config.seed, loader=self.config.loader, num_workers=self.config.loader_workers,
            position=self.files.position_after(start_step), row_groups=self.train_groups,
            shuffle_rows=self.config.shuffle_rows)
        it = self._iter = iter(self._loader)
        # The loader is endless: next() never raises StopIteration here.
        return (to_torchrec(next(it)) for _ in range(start_step, end_step))

    @property
    def held_out_description(self) -> str:
        """What `held_out` reads, for the summary: the files, or the synthetic split."""
        if self.config.eval_data is not None:
            return f"--eval-data {self.config.eval_data}"
        if self.eval_groups is not None:
            by = "latest by timestamp" if self.spec is not None and self.spec.timestamp else \
                "last in file order"
            return (f"--eval-fraction {self.config.eval_fraction} of --data: "
                    f"{len(self.eval_groups)} row groups, {by}, "
                    f"{self.held_out_share():.1%} of the rows")
        return "the synthetic held-out split"

    def held_out_share(self) -> float:
        """The share of --data's rows that --eval-fraction's split holds out."""
        info = self._split_info
        return sum(info.row_groups[i][2] for i in self.eval_groups) / max(1, info.num_rows)

    def split_warning(self) -> Optional[str]:
        """A line when the held-out split holds far more of the rows than --eval-fraction asks
        (more than 1.5 times, and 2 points, more): whole row groups are held out, and a table
        written in few large ones (one a bucket) would be split by row group, not by time."""
        if self.eval_groups is None:
            return None
        asked, held, info = self.config.eval_fraction, self.held_out_share(), self._split_info
        if held <= max(1.5 * asked, asked + 0.02):
            return None
        largest = max(r for _, _, r in info.row_groups)
        return (f"--eval-fraction {asked} holds out {held:.1%} of the rows: "
                f"{len(self.eval_groups)} whole row groups of up to {largest:,} rows, at least "
                f"one per rank. To hold out what was asked, "
                + _fewer_rows_per_group(info, asked, self.world_size))

    def held_out_batches(self) -> int:
        """Batches per rank `held_out` yields (the same on every rank: each of them runs the
        sharded model's collectives)."""
        cap = self.config.eval_batches
        if self.eval_files is None:
            if cap is not None:
                return cap
            return max(1, -(-SYNTHETIC_HELD_OUT // (self.config.batch_size * self.world_size)))
        n = self.eval_files.num_batches()
        return n if cap is None else min(n, cap)

    def held_out(self) -> Iterator[TorchRecBatch]:
        """This rank's held-out batches: its whole share of the held-out files, or of the
        synthetic held-out split; the first --eval-batches of it when given."""
        n = self.held_out_batches()
        if self.eval_files is None:
            for i in range(n):
                yield to_torchrec(self.dataset.batch(HELD_OUT_START + i))
            return
        it = iter(self.eval_files)
        try:
            for _, batch in zip(range(n), it):
                yield to_torchrec(batch)
        finally:
            it.close()

    def loader_wait(self) -> Optional[Tuple[str, float]]:
        """(what, time.monotonic() the wait began) while this rank waits for a training batch
        from a loader worker (a process, or the reading thread) that is alive: a slow read or
        transform, which the watchdog does not take for a hang; None otherwise. Called from the
        watchdog's thread."""
        for source in (self._loader, self._iter):
            waiting = getattr(source, "waiting", None)
            found = waiting() if waiting is not None else None
            if found is not None:
                return found
        return None

    def close(self) -> None:
        """Release the training loader: its worker processes stop, a Ray it started shuts
        down. Idempotent; call it when training ends."""
        it, loader, self._iter, self._loader = self._iter, self._loader, None, None
        if it is not None:
            it.close()  # stops the worker processes
        if loader is not None:
            loader.close()


def _flagged(flag: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), its FileNotFoundError or ValueError prefixed with `flag`."""
    try:
        return fn(*args, **kwargs)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"{flag}: {e}") from None
