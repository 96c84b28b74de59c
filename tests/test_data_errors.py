"""Bad Parquet input: each case raises a clear error naming the file, and no partial batch."""

import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_pipeline_cases import assert_batches_equal, random_batches, write

from recxla.data import DataFormatError, ParquetDataset, embedding_bag_configs, make_loader
from recxla.data.profiles import Profile, SparseFeature


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.parquet: no such file"):
        ParquetDataset(str(tmp_path / "nothere.parquet"), 8)
    os.mkdir(tmp_path / "empty")
    with pytest.raises(DataFormatError, match="empty: the folder holds no .parquet files"):
        ParquetDataset(str(tmp_path / "empty"), 8)


def test_truncated_file(tmp_path):
    path = write(random_batches(3, 20), tmp_path / "t.parquet")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(random.randint(size // 4, size - 1))
    with pytest.raises(DataFormatError, match=r"t\.parquet: not a readable Parquet file"):
        ParquetDataset(path, 20)


def _flip_data_byte(path: str, row_group: int) -> None:
    """Flip one byte in the middle of the largest column chunk of a row group."""
    md = pq.ParquetFile(path).metadata.row_group(row_group)
    col = max((md.column(i) for i in range(md.num_columns)), key=lambda c: c.total_compressed_size)
    start = col.dictionary_page_offset or col.data_page_offset
    pos = start + col.total_compressed_size // 2
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_corrupt_row_group_raises_after_the_good_batches(tmp_path, num_workers):
    batches = random_batches(4, 40, max_len=20)
    path = write(batches, tmp_path / "c.parquet")
    bad = random.randint(1, 3)
    _flip_data_byte(path, bad)
    it = iter(make_loader(path, 40, num_workers=num_workers, num_epochs=1, shuffle=False))
    for k in range(bad):
        assert_batches_equal(next(it), batches[k])
    with pytest.raises(DataFormatError, match=rf"c\.parquet: row group {bad}"):
        next(it)
    with pytest.raises(StopIteration):  # nothing after a failure
        next(it)


def test_file_not_written_by_recxla(tmp_path):
    pq.write_table(pa.table({"x": [1, 2, 3]}), tmp_path / "foreign.parquet")
    with pytest.raises(DataFormatError, match="foreign.parquet: no 'recxla.data.layout' metadata"):
        ParquetDataset(str(tmp_path / "foreign.parquet"), 1)


def test_columns_that_differ_from_the_layout(tmp_path):
    path = write(random_batches(2, 10), tmp_path / "a.parquet")
    table = pq.read_table(path)
    footer = pq.ParquetFile(path).metadata.metadata
    meta = {k: v for k, v in footer.items() if k.startswith(b"recxla.")}
    # Same metadata, one column dropped and one retyped: the kind of file a hand edit makes.
    table = table.drop_columns(["dense:1"]).set_column(
        table.schema.get_field_index("label") - 1, "label", pa.array(
            table.column("label").to_numpy().astype("float64")))
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "b.parquet")
    with pytest.raises(DataFormatError, match=r"b.parquet: .*missing \['dense:1'\]"):
        ParquetDataset(str(tmp_path / "b.parquet"), 1)


def test_files_of_one_folder_must_share_a_layout(tmp_path):
    os.mkdir(tmp_path / "d")
    write(random_batches(2, 10), tmp_path / "d" / "part-0.parquet")
    write(random_batches(2, 10, num_dense=4), tmp_path / "d" / "part-1.parquet")
    with pytest.raises(DataFormatError, match=r"part-1.parquet: num_dense is 4.*part-0.parquet"):
        ParquetDataset(str(tmp_path / "d"), 10)


def test_check_tables(tmp_path):
    features = [SparseFeature(f"f{i}", 50 + 10 * i, "item", "attribute") for i in range(3)]
    profile = Profile(name="p", features=tuple(features), num_users=10, num_items=20,
                      num_categories=2)
    batches = random_batches(2, 30, features=[f.name for f in features], id_range=50)
    ds = ParquetDataset(write(batches, tmp_path / "t.parquet"), 30)
    tables = embedding_bag_configs(profile, embedding_dim=4)
    ds.check_tables(tables, num_dense=3)
    with pytest.raises(DataFormatError, match="files hold 3 dense features, the model takes 13"):
        ds.check_tables(tables, num_dense=13)
    small = embedding_bag_configs(profile.capped(20), embedding_dim=4)
    with pytest.raises(DataFormatError, match=r"feature 'f0' has ids in \[\d+, \d+\], table "
                                              r"t_f0 has 20 rows"):
        ds.check_tables(small)
    other = embedding_bag_configs(profile, embedding_dim=4)
    other[1].feature_names = ["g"]
    with pytest.raises(DataFormatError, match="table t_f1 reads feature 'g'"):
        ds.check_tables(other)
