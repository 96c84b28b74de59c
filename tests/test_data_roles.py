"""Column roles inferred without a schema (recxla.data.convert_plan, id_counts.flag_measures),
for a conversion and for a raw table read at train time (recxla.data.read_time, what `python
-m recxla.data info` and the trainer print): a string column of a typed source is ids whatever
its values look like (a CSV column, whose type is a guess, is still checked); an integer column
with more distinct values than half the rows keeps its role as ids with a warning that names
the schema lines for either role; a schema entry always wins."""

import contextlib
import io

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from recxla.data import convert, read_dataset_spec
from recxla.data.__main__ import main as data_main
from recxla.data.id_counts import MEASURE_MIN_DISTINCT
from recxla.data.read_time import ReadTimeTable

N = 3000


def _zips(rng, n: int) -> np.ndarray:
    """MovieLens-style zip codes: digits with leading zeros, and a Canadian code now and then."""
    digits = np.array([f"{z:03d}" for z in rng.integers(0, 1000, n)])
    return np.where(rng.random(n) < 0.05, "T8H1N", digits)


def _table(rng, n: int = N, **extra) -> pa.Table:
    return pa.table({"user": rng.integers(0, 50, n), "price": rng.random(n),
                     "label": rng.integers(0, 2, n), **extra})


def _roles(path, schema=None) -> dict:
    """{column: its role line} as `convert` prints them, and as a raw table's reader makes
    them (the two must agree)."""
    out = path.parent / f"out-{path.stem}"
    lines = []
    convert(path, out, schema, progress=False, on_roles=lines.extend, overwrite=True)
    raw = ReadTimeTable(str(path), schema)
    assert raw.plan.roles == lines
    return {line.split("'")[1]: line for line in lines}


def test_a_string_column_of_a_parquet_table_is_ids_whatever_its_values(tmp_path, seed):
    """Zip codes ("021", "945", now and then "T8H1N") and a string column of digits only are
    string ids, in a conversion and read raw; the same values in a CSV file, whose column
    types are guessed from the text, are still the error that asks which role they have."""
    rng = np.random.default_rng(seed)
    zips = _zips(rng, N)
    codes = np.array([str(c) for c in rng.integers(0, 20, N)])
    pq.write_table(_table(rng, zip=zips, code=codes), tmp_path / "t.parquet")
    roles = _roles(tmp_path / "t.parquet")
    for c in ("zip", "code"):
        assert roles[c] == f"column '{c}': sparse feature {c} (table t_{c}): string ids, inferred"
    spec = read_dataset_spec(tmp_path / "out-t")
    assert spec.sparse_features == ("user", "zip", "code")
    assert spec.table_of("zip").num_rows == len(set(zips)) + 1  # a vocabulary of the strings
    assert spec.table_of("zip").id_type == "string"

    pcsv.write_csv(_table(rng, zip=zips), tmp_path / "t.csv")
    with pytest.raises(ValueError, match=r"t.csv: row \d+: column 'zip': 'T8H1N' is not a "
                                         r"number .* name it in the schema \(\[sparse.zip\]\)"):
        convert(tmp_path / "t.csv", tmp_path / "csv", progress=False)


def test_a_string_column_the_schema_names_dense_is_an_error_naming_it(tmp_path, seed):
    rng = np.random.default_rng(seed)
    codes = np.array([str(c) for c in rng.integers(0, 20, N)])
    pq.write_table(_table(rng, zip=_zips(rng, N), code=codes), tmp_path / "t.parquet")
    (tmp_path / "s.toml").write_text('dense = ["price", "zip"]\n')
    with pytest.raises(ValueError, match=r"row \d+: column 'zip': 'T8H1N' is not a number "
                                         r"\(the schema names it dense"):
        ReadTimeTable(str(tmp_path / "t.parquet"), tmp_path / "s.toml")
    (tmp_path / "s.toml").write_text('dense = ["price", "code"]\n')
    with pytest.raises(ValueError, match=r"column 'code' holds string: dense features must be "
                                         r"numbers \(cast it in a transform"):
        convert(tmp_path / "t.parquet", tmp_path / "out", tmp_path / "s.toml", progress=False)


def test_an_integer_column_with_as_many_values_as_rows_is_flagged(tmp_path, seed):
    """Adult's fnlwgt: an integer with a value for almost every row keeps its role as ids, with
    a warning on its line naming the schema lines that make it dense or keep it an id; the
    trainer, `info` and `convert` print that line."""
    rng = np.random.default_rng(seed)
    weight = rng.choice(np.arange(10**4, 10**6), N, replace=False)  # N distinct values
    pq.write_table(_table(rng, fnlwgt=weight), tmp_path / "t.parquet")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert data_main(["convert", str(tmp_path / "t.parquet"), "--out",
                          str(tmp_path / "out"), "--no-progress"]) == 0
    want = ("column 'fnlwgt': sparse feature fnlwgt (table t_fnlwgt): int64 ids, inferred; "
            f"warning: an integer with {N:,} distinct values in {N:,} rows, more like a measure "
            "than an id: to train it as a number, name it in the schema's dense (dense = "
            '["price", "fnlwgt"]); to keep it an id, declare [sparse.fnlwgt]')
    assert want in stdout.getvalue().splitlines(), stdout.getvalue()
    assert read_dataset_spec(tmp_path / "out").sparse_features == ("user", "fnlwgt")
    assert _roles(tmp_path / "t.parquet")["fnlwgt"] == want

    # Either schema line the warning names settles the role, and the warning goes.
    (tmp_path / "dense.toml").write_text('dense = ["price", "fnlwgt"]\n')
    assert _roles(tmp_path / "t.parquet", tmp_path / "dense.toml")["fnlwgt"] == \
        "column 'fnlwgt': dense 1: the schema's dense"
    assert read_dataset_spec(tmp_path / "out-t").dense_features == ("price", "fnlwgt")
    (tmp_path / "sparse.toml").write_text("[sparse.fnlwgt]\n")
    assert _roles(tmp_path / "t.parquet", tmp_path / "sparse.toml")["fnlwgt"] == \
        "column 'fnlwgt': sparse feature fnlwgt (table t_fnlwgt): the schema's [sparse.fnlwgt]"

    # Counted past a vocab_limit at or above half the rows: more distinct values than it.
    (tmp_path / "limit.toml").write_text(f"vocab_limit = {N // 2}\n")
    assert f"more than {N // 2:,} distinct values in {N:,} rows" in _roles(
        tmp_path / "t.parquet", tmp_path / "limit.toml")["fnlwgt"]
    # Below half the rows the limit cannot tell: the column is not flagged.
    (tmp_path / "limit.toml").write_text(f"vocab_limit = {N // 2 - 100}\n")
    assert "warning" not in _roles(tmp_path / "t.parquet", tmp_path / "limit.toml")["fnlwgt"]


def test_ids_that_repeat_or_are_few_are_not_flagged(tmp_path, seed):
    """Half the rows or fewer distinct values (a user id in a log), at most
    MEASURE_MIN_DISTINCT of them (a small log), or a bag of ids: no warning."""
    rng = np.random.default_rng(seed)
    n = 2 * MEASURE_MIN_DISTINCT - 2
    half = rng.choice(np.arange(10**6), n // 2, replace=False)
    small = rng.choice(np.arange(10**6), MEASURE_MIN_DISTINCT, replace=False)
    bags = pa.array([[int(x)] for x in rng.choice(np.arange(10**6), n, replace=False)])
    pq.write_table(_table(rng, n, item=np.concatenate([half, half]),
                          few=np.concatenate([small, small[:n - len(small)]]),
                          history=bags), tmp_path / "t.parquet")
    roles = _roles(tmp_path / "t.parquet")
    assert not any("warning" in line for line in roles.values()), roles
    assert roles["few"].endswith("int64 ids, inferred")
