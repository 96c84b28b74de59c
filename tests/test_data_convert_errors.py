"""python -m recxla.data convert on bad input: each error names the file, the column and, where
it applies, the row; nothing is left behind at the output or next to it."""

import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_convert_cases import criteo_lines

from recxla.data import convert, load_schema
from recxla.data.hashing import splitmix64, splitmix64_numpy


def _parquet(path, n=50, **override):
    cols = {"user": [f"u{i % 7}" for i in range(n)], "item": list(range(n)),
            "x": [float(i) for i in range(n)], "label": [i % 2 for i in range(n)]}
    cols.update(override)
    pq.write_table(pa.table(cols), path)
    return path


def _convert_fails(tmp_path, src, match, schema=None, **kwargs):
    """convert raises ValueError matching `match`; the output folder and any temporary folder
    are gone afterwards."""
    if schema is not None:
        (tmp_path / "schema.toml").write_text(schema)
        schema = tmp_path / "schema.toml"
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        convert(src, out, schema, progress=False, rows_per_group=16, **kwargs)
    assert not out.exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".out.tmp")]


def test_column_named_in_schema_but_missing(tmp_path):
    src = _parquet(tmp_path / "in.parquet")
    _convert_fails(tmp_path, src, r"in.parquet: column 'genres' \(sparse feature genres in the "
                   r"schema\) is not in the file", "[sparse.genres]\n")


@pytest.mark.parametrize("label, match", [
    ([0, 1, 2, 1] * 5, r"in.parquet: row 3: column 'label': label 2.0 is not 0 or 1"),
    (["yes", "no"] * 10, r"in.parquet: column 'label': the label must be 0/1 or a float, the "
                         r"column holds string"),
])
def test_label_that_is_not_0_1_or_a_float(tmp_path, label, match):
    src = _parquet(tmp_path / "in.parquet", n=20, label=label)
    _convert_fails(tmp_path, src, match)


def test_float_label_is_accepted_as_float_kind(tmp_path):
    src = _parquet(tmp_path / "in.parquet", n=20, label=[random.uniform(0, 5) for _ in range(20)])
    (tmp_path / "s.toml").write_text('label_kind = "float"\n')
    spec = convert(src, tmp_path / "out", tmp_path / "s.toml", progress=False)
    assert spec.label_kind == "float"


def test_list_of_floats_declared_sparse(tmp_path):
    src = _parquet(tmp_path / "in.parquet", n=10, emb=[[0.5, 1.5]] * 10)
    _convert_fails(tmp_path, src, r"in.parquet: column 'emb' holds list<element: double>: a sparse "
                   r"feature needs integer or string ids", "[sparse.emb]\n")


@pytest.mark.parametrize("name, fmt", [("in.parquet", None), ("in.csv", None),
                                       ("day_0", "criteo-tsv")])
def test_empty_file(tmp_path, name, fmt):
    (tmp_path / name).write_bytes(b"")
    _convert_fails(tmp_path, tmp_path / name, f"{name}: the file is empty", fmt=fmt)


def test_csv_header_without_rows(tmp_path):
    (tmp_path / "in.csv").write_text("user,item,label\n")
    _convert_fails(tmp_path, tmp_path / "in.csv", "in.csv: the file holds a header but no rows")


def test_csv_with_a_ragged_row(tmp_path):
    lines = ["user,item,x,label"] + [f"u{i},{i},{i / 3},{i % 2}" for i in range(40)]
    lines[27] = "u26,26,1.0"
    (tmp_path / "in.csv").write_text("\n".join(lines) + "\n")
    _convert_fails(tmp_path, tmp_path / "in.csv",
                   r"in.csv: row 27 \(line 28\): 3 fields, expected 4: 'u26,26,1.0'")


def test_tsv_with_38_fields(tmp_path):
    lines = criteo_lines(30, random.Random(1), missing=0.0)
    lines[11] = "\t".join(lines[11].split("\t")[:38])
    (tmp_path / "day_0").write_text("\n".join(lines) + "\n")
    _convert_fails(tmp_path, tmp_path / "day_0", r"day_0: row 12 \(line 12\): 38 tab-separated "
                   "fields, expected 40", fmt="criteo-tsv")


def test_tsv_with_a_bad_hex_id(tmp_path):
    lines = criteo_lines(30, random.Random(2), missing=0.0)
    fields = lines[20].split("\t")
    fields[14 + 5] = "zz12"
    lines[20] = "\t".join(fields)
    (tmp_path / "day_0").write_text("\n".join(lines) + "\n")
    _convert_fails(tmp_path, tmp_path / "day_0", r"day_0: column cat_5: row 21: 'zz12' is not "
                   "a hex id", fmt="criteo-tsv")


def test_second_file_failing_in_a_worker_leaves_nothing(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _parquet(src / "a.parquet")
    _parquet(src / "b.parquet", label=[0] * 30 + [3] + [1] * 19)
    _convert_fails(tmp_path, src, r"b.parquet: row 31: column 'label'", workers=2)


def test_existing_output_is_kept_unless_overwrite(tmp_path):
    src = _parquet(tmp_path / "in.parquet")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        convert(src, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "keep.txt").exists()
    convert(src, tmp_path / "out", progress=False, overwrite=True)
    assert sorted(os.listdir(tmp_path / "out")) == ["part-00000.parquet", "vocab"]


@pytest.mark.parametrize("text, match", [
    ("labl = 'x'\n", r"unknown key\(s\) \['labl'\]"),
    ("[sparse.a]\nmapping = 'md5'\n", r"\[sparse.a\]: mapping must be one of"),
    ("[sparse.a]\ntable = 'items'\n", r"\[sparse.a\]: table 'items' has no \[tables.items\]"),
    ("[sparse.a]\ntable = 'items'\n[tables.items]\n[tables.unused]\n",
     r"no sparse feature reads table\(s\) \['unused'\]"),
    ("[sparse.a]\nrows = 0\n", r"\[sparse.a\]: rows must be >= 1, got 0"),
    ("label = \n", "not valid TOML"),
])
def test_schema_file_errors_name_the_file_and_key(tmp_path, text, match):
    (tmp_path / "s.toml").write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        load_schema(tmp_path / "s.toml")
    assert "s.toml" in str(e.value)


def test_splitmix64_numpy_matches_torch(seed):
    import numpy as np
    import torch

    x = np.random.default_rng(seed).integers(-(2**63), 2**63 - 1, 1000)
    want = splitmix64(torch.from_numpy(x)).numpy().view(np.uint64)
    assert (splitmix64_numpy(x) == want).all()


def test_command_line_reports_a_bad_csv_value_and_exits_2(tmp_path):
    """The message names the file and column, the status is the command's 2. (The reader is
    closed before the error propagates: left open, its read-ahead threads sometimes aborted
    the process at exit with status 134, about 1 run in 3.)"""
    import subprocess
    import sys

    # Past the first block (1 MiB), from which the column's type (int64) was inferred.
    rows = "".join(f"{i},{i % 2}\n" for i in range(150_000))
    (tmp_path / "in.csv").write_text(f"item,label\n{rows}abc,0\n")
    res = subprocess.run([sys.executable, "-m", "recxla.data", "convert", str(tmp_path / "in.csv"),
                          "--out", str(tmp_path / "out"), "--no-progress"],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert res.returncode == 2, res.stderr[-2000:]
    # pyarrow's serial reader (recxla.data.convert_source) counts rows: #150002 is the line.
    assert ("in.csv: In CSV column #0: Row #150002: CSV conversion error to int64: invalid "
            "value 'abc'") in res.stderr
    assert not (tmp_path / "out").exists()
