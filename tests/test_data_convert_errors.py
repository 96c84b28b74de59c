"""python -m recxla.data convert on bad input: each error names the file, the column and, where
it applies, the row; nothing is left behind at the output or next to it."""

import os
import random
import re

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


def test_existing_output_is_kept_without_overwrite(tmp_path):
    src = _parquet(tmp_path / "in.parquet")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        convert(src, tmp_path / "out", progress=False)
    assert os.listdir(tmp_path / "out") == ["keep.txt"]


@pytest.mark.parametrize("text, match", [
    ("labl = 'x'\n", r"unknown key\(s\) \['labl'\]"),
    ("[sparse.a]\nmapping = 'md5'\n", r"\[sparse.a\]: mapping must be one of"),
    ("[sparse.a]\ntable = 'items'\n", r"\[sparse.a\]: table 'items' has no \[tables.items\]"),
    ("[sparse.a]\ntable = 'items'\n[tables.items]\n[tables.unused]\n",
     r"no sparse feature reads table\(s\) \['unused'\]"),
    ("[sparse.a]\nrows = 0\n", r"\[sparse.a\]: rows must be >= 1, got 0"),
    ("label = \n", "not valid TOML"),
    ("[sparse.a]\nhistory_of = 3\n", r"\[sparse.a\]: history_of must be a str, got 3"),
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
    # pyarrow's serial reader (recxla.data.convert_csv) counts rows: #150002 is the line.
    assert ("in.csv: row 150001 (line 150002): column 'item': 'abc' is not a number (the "
            "column holds int64") in res.stderr
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# --overwrite replaces only a dataset that convert wrote, and never the input.

def _cli(*args):
    """python -m recxla.data, in this process: (status, stdout, stderr)."""
    import contextlib
    import io

    from recxla.data.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([str(a) for a in args])
    return status, out.getvalue(), err.getvalue()


def test_overwrite_refuses_the_folder_that_holds_the_input(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    _parquet(logs / "a.parquet")
    before = (logs / "a.parquet").read_bytes()
    with pytest.raises(ValueError, match=rf"{logs}: holds the input .*a.parquet.*refusing"):
        convert(logs, logs, progress=False, overwrite=True)
    status, _, err = _cli("convert", logs, "--out", logs, "--overwrite", "--no-progress")
    assert status == 2 and f"{logs}: holds the input" in err, err
    assert sorted(os.listdir(logs)) == ["a.parquet"]
    assert (logs / "a.parquet").read_bytes() == before


def test_overwrite_refuses_a_dataset_that_holds_the_input(tmp_path):
    """Converting a converted file into its own folder would delete it."""
    src = _parquet(tmp_path / "in.parquet")
    convert(src, tmp_path / "out", progress=False)
    part = tmp_path / "out" / "part-00000.parquet"
    with pytest.raises(ValueError, match="holds the input"):
        convert(part, tmp_path / "out", progress=False, overwrite=True)
    assert part.exists()


@pytest.mark.parametrize("extra", ["notes.txt", "mine.parquet", "vocab/mine.txt"])
def test_overwrite_refuses_a_folder_convert_did_not_write(tmp_path, extra):
    src = _parquet(tmp_path / "in.parquet")
    out = tmp_path / "out"
    if extra != "mine.parquet":
        convert(src, out, progress=False)  # a dataset, with something of the user's added
    (out / extra).parent.mkdir(parents=True, exist_ok=True)
    if extra.endswith(".parquet"):
        pq.write_table(pa.table({"x": [1, 2]}), out / extra)
    else:
        (out / extra).write_text("keep me")
    with pytest.raises(ValueError, match=rf"{out}: .*{extra.split('/')[-1]}.*not written by "
                       "recxla.data convert"):
        convert(src, out, progress=False, overwrite=True)
    assert (out / extra).exists()
    status, _, err = _cli("convert", src, "--out", out, "--overwrite", "--no-progress")
    assert status == 2 and str(out) in err, err
    assert (out / extra).exists()


def test_overwrite_replaces_a_dataset_convert_wrote(tmp_path):
    src = _parquet(tmp_path / "in.parquet")
    out = tmp_path / "out"
    convert(src, out, progress=False)
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        convert(src, out, progress=False)
    _parquet(src, n=80)
    convert(src, out, progress=False, overwrite=True)
    assert sorted(os.listdir(out)) == ["part-00000.parquet", "vocab"]
    assert pq.read_metadata(out / "part-00000.parquet").num_rows == 80


# ---------------------------------------------------------------------------------------------
# Values that would train to nan, that are not text, or that are numbers but for a few.

@pytest.mark.parametrize("bad, shown", [(float("nan"), "nan"), (float("inf"), "inf"),
                                        (-float("inf"), "-inf"), (1e300, "1e+300")])
def test_non_finite_dense_value(tmp_path, bad, shown):
    x = [random.random() for _ in range(50)]
    x[36] = bad
    src = _parquet(tmp_path / "in.parquet", x=x)
    _convert_fails(tmp_path, src, rf"in.parquet: row 37: column 'x': dense value "
                   rf"{re.escape(shown)} is not a finite float32")


def test_non_finite_dense_value_in_csv_and_in_weights(tmp_path):
    lines = ["user,item,x,label"] + [f"u{i},{i},{random.random()},{i % 2}" for i in range(40)]
    lines[9] = "u8,8,inf,0"
    (tmp_path / "in.csv").write_text("\n".join(lines) + "\n")
    _convert_fails(tmp_path, tmp_path / "in.csv", r"in.csv: row 9: column 'x': dense value inf")
    w = [[1.0], [0.5]] * 10
    w[13] = [float("nan")]
    src = _parquet(tmp_path / "w.parquet", n=20, tags=[[1], [2]] * 10, w=w)
    _convert_fails(tmp_path, src, r"w.parquet: row 14: column 'w': weight nan is not a finite",
                   "[sparse.tags]\nweights = 'w'\n")


def _csv_with(path, row: int, fields: bytes, n=3000) -> None:
    """user_id,item,x,label rows; data row `row` (1-based) replaced by `fields`."""
    lines = [b"user_id,item,x,label"] + [b"u%d,%d,%f,%d" % (i % 50, i, i / 7, i % 2)
                                         for i in range(n)]
    lines[row] = fields
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_non_utf8_csv_value_is_an_error_not_a_left_out_column(tmp_path):
    _csv_with(tmp_path / "in.csv", 101, b"u\xff\xfe,5,1.0,0")
    _convert_fails(tmp_path, tmp_path / "in.csv", r"in.csv: row 101: column 'user_id': "
                   r"b'u\\xff\\xfe' is not UTF-8 text")
    status, _, err = _cli("convert", tmp_path / "in.csv", "--out", tmp_path / "out",
                          "--no-progress")
    assert status == 2 and "row 101: column 'user_id'" in err, err
    # A column the schema ignores is not read: its bytes are not checked.
    (tmp_path / "s.toml").write_text("ignore = ['user_id']\n")
    spec = convert(tmp_path / "in.csv", tmp_path / "out", tmp_path / "s.toml", progress=False)
    assert spec.sparse_features == ("item",)


def test_non_utf8_csv_value_past_the_first_block(tmp_path):
    _csv_with(tmp_path / "in.csv", 90_000, b"u\xff,5,1.0,0", n=100_000)
    _convert_fails(tmp_path, tmp_path / "in.csv", r"in.csv: row 90000 \(line 90001\): column "
                   "'user_id': a value is not UTF-8 text")


@pytest.mark.parametrize("row, fields, match", [
    (11, b"u1,5,abc,0", r"in.csv: row 11: column 'x': 'abc' is not a number"),
    (12, b"u1,xyz,0.5,0", r"in.csv: row 12: column 'item': 'xyz' is not a number"),
])
def test_a_number_column_with_a_string_in_the_first_block(tmp_path, row, fields, match):
    _csv_with(tmp_path / "in.csv", row, fields)
    _convert_fails(tmp_path, tmp_path / "in.csv", match)


def test_a_number_column_with_a_string_past_the_first_block(tmp_path):
    _csv_with(tmp_path / "in.csv", 90_000, b"u1,5,abc,0", n=100_000)
    _convert_fails(tmp_path, tmp_path / "in.csv", r"in.csv: row 90000 \(line 90001\): column "
                   r"'x': 'abc' is not a number \(the column holds double")


def test_a_dense_column_named_in_the_schema_that_holds_a_string(tmp_path):
    _csv_with(tmp_path / "in.csv", 7, b"u1,5,n/a!,0")
    _convert_fails(tmp_path, tmp_path / "in.csv", r"in.csv: row 7: column 'x': 'n/a!' is not a "
                   "number", "dense = ['x']\n")


def test_a_string_id_column_with_a_few_numbers_stays_sparse(tmp_path):
    lines = ["user,item,label"] + [f"{'u' if i % 10 else ''}{i},{i},{i % 2}" for i in range(60)]
    (tmp_path / "in.csv").write_text("\n".join(lines) + "\n")
    spec = convert(tmp_path / "in.csv", tmp_path / "out", progress=False)
    assert spec.sparse_features == ("user", "item")


# ---------------------------------------------------------------------------------------------
# Clear errors instead of tracebacks.

def test_csv_folder_whose_second_file_lacks_a_column(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.csv").write_text("user,item,label\n" + "".join(f"u{i},{i},{i % 2}\n"
                                                            for i in range(20)))
    (src / "b.csv").write_text("user,label\n" + "".join(f"u{i},{i % 2}\n" for i in range(20)))
    _convert_fails(tmp_path, src, r"b.csv: column 'item' is not in the file \(the first file "
                   r"has it\)")


def test_label_named_in_the_schema_but_missing(tmp_path):
    src = _parquet(tmp_path / "in.parquet")
    _convert_fails(tmp_path, src, r"in.parquet: column 'clicked' \(the label in the schema\) is "
                   "not in the file", "label = 'clicked'\n")


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_full_disk_names_the_output_and_leaves_nothing(tmp_path, monkeypatch, overwrite):
    import errno

    from recxla.data import parquet_writer

    src = _parquet(tmp_path / "in.parquet", n=200)
    out = tmp_path / "out"
    if overwrite:
        convert(src, out, progress=False)
        before = sorted(os.listdir(out))
    calls = []

    def full(self, group):
        calls.append(group.num_rows)
        if len(calls) > 2:  # the disk fills up in the middle of the file
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, group)

    write = parquet_writer._FileSink.write
    monkeypatch.setattr(parquet_writer._FileSink, "write", full)
    with pytest.raises(OSError, match=rf"writing {out}: .*No space left on device.*nothing "
                       f"was written") as e:
        convert(src, out, progress=False, rows_per_group=16, workers=1, overwrite=overwrite)
    assert e.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path)) == ["in.parquet"] + (["out"] if overwrite else [])
    if overwrite:  # the old dataset is kept as it was
        assert sorted(os.listdir(out)) == before
    calls.clear()
    status, _, err = _cli("convert", src, "--out", out, "--workers", "1", "--rows-per-group",
                          "16", "--no-progress", *(["--overwrite"] if overwrite else []))
    assert status == 1 and f"error: recxla.data.convert: writing {out}: No space left" in err
    assert sorted(os.listdir(tmp_path)) == ["in.parquet"] + (["out"] if overwrite else [])


def test_id_mapper_reads_vocabularies_only_inside_the_dataset(tmp_path):
    """A footer is data: a vocabulary path that leaves the dataset's vocab/ folder is refused
    before anything is read from it."""
    import json

    from recxla.data import DataFormatError, IdMapper
    from recxla.data.parquet_layout import SPEC_KEY

    src = _parquet(tmp_path / "in.parquet")
    out = tmp_path / "out"
    convert(src, out, progress=False)
    part = out / "part-00000.parquet"
    table = pq.read_table(part)
    meta = dict(pq.read_metadata(part).metadata)
    spec = json.loads(meta[SPEC_KEY])
    spec["tables"][0]["vocabulary"] = "vocab/../../in.parquet"
    meta[SPEC_KEY] = json.dumps(spec).encode()
    pq.write_table(table.replace_schema_metadata(meta), part)
    with pytest.raises(DataFormatError, match=r"vocabulary 'vocab/../../in.parquet' is not a "
                       "file in the dataset's vocab/ folder"):
        IdMapper.from_dataset(out)


@pytest.mark.parametrize("schema, match", [
    ('[sparse.seen]\nhistory_of = "items"\n',
     r"\[sparse.seen\] history_of = 'items': not another sparse feature; the sparse features "
     r"are \["),
    ('[sparse.seen]\nhistory_of = "seen"\n', r"history_of = 'seen': not another sparse"),
    ('[sparse.item]\ntable = "items"\n[sparse.seen]\ntable = "items"\nhistory_of = "item"\n'
     '[tables.items]\n',
     r"\[sparse.seen\]: history 'seen' reads table items \(features \['item', 'seen'\], "
     r"weighted False\): a history needs an unweighted table of its own"),
    ('[sparse.seen]\nhistory_of = "item"\nweights = "w"\n',
     r"history 'seen' reads table t_seen \(features \['seen'\], weighted True\)"),
])
def test_a_history_that_cannot_be_one_names_the_feature(tmp_path, schema, match):
    """A history's candidate is another sparse feature; its table is its own and unweighted
    (an EmbeddingCollection reads it unpooled): refused before any id is counted."""
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"item": [1, 2, 3], "seen": [[1, 2], [], [3]],
                             "w": [[0.5, 1.0], [], [2.0]], "label": [0, 1, 0]}), src)
    _convert_fails(tmp_path, src, match, schema=schema)


def test_a_table_name_with_a_leading_dot_maps_ids(tmp_path):
    """A table named ".hidden" gets a vocabulary file that is not hidden: the dataset it
    converts into maps ids with IdMapper, as the conversion did."""
    from recxla.data import IdMapper, read_dataset_spec

    src = _parquet(tmp_path / "in.parquet")
    (tmp_path / "s.toml").write_text('[sparse.user]\ntable = ".hidden"\n[tables.".hidden"]\n'
                                     'mapping = "vocab"\n')
    convert(src, tmp_path / "out", tmp_path / "s.toml", progress=False)
    vocabulary = read_dataset_spec(tmp_path / "out").table_of("user").vocabulary
    assert not os.path.basename(vocabulary).startswith(".")
    rows = IdMapper.from_dataset(tmp_path / "out").map("user", ["u0", "u3", "nobody"])
    # The vocabulary: most frequent first (u0: 8 of the 50 rows, u1..u6: 7 each, smaller
    # first), from row 1; row 0 for ids not in it.
    assert rows.tolist() == [1, 4, 0]
