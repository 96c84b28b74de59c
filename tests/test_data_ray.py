"""The Ray Data loader: the same batches as the local loaders, a local Ray bound to 127.0.0.1
with its files in the run directory, resumable positions, errors from the tasks."""

import glob
import json
import os
import random
import threading

import pytest
from data_pipeline_cases import assert_batches_equal, random_batches, write

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'recxla[ray]'")

from recxla.data import DataFormatError, ParquetDataset, make_loader  # noqa: E402
from recxla.data.ray_loader import RayLoader  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One local Ray for the module (the first loader starts it); shut down at the end."""
    path = tmp_path_factory.mktemp("run")
    yield str(path)
    if ray.is_initialized():
        ray.shutdown()


def _loader(path, b, run_dir, **kwargs):
    return make_loader(path, b, loader="ray", num_workers=2, run_dir=run_dir, **kwargs)


@pytest.mark.parametrize("shuffle_rows", [30, None])
def test_ray_loader_yields_the_local_batches(tmp_path, run_dir, shuffle_rows):
    # Windows of one 25-row group (30), or all of a rank's groups (the default): with the
    # first, batches straddle windows and their pieces come from two Ray tasks.
    path = write(random_batches(6, 25) + random_batches(1, 10), tmp_path / "data",
                 rows_per_file=50)
    b = random.randint(8, 30)
    kwargs = dict(rank=1, world_size=2, seed=random.randint(0, 99), num_epochs=2)
    if shuffle_rows is not None:
        kwargs["shuffle_rows"] = shuffle_rows
    loader = _loader(path, b, run_dir, **kwargs)
    assert isinstance(loader, RayLoader)
    got = list(loader)
    want = list(make_loader(path, b, num_workers=1, **kwargs))
    assert len(got) == len(want) == loader.num_batches(0) + loader.num_batches(1)
    for g, w in zip(got, want):
        assert_batches_equal(g, w)
    # The loader started Ray itself: private, on 127.0.0.1, files under run_dir/ray.
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    assert all(n["NodeManagerAddress"] == "127.0.0.1" for n in ray.nodes())
    assert glob.glob(os.path.join(run_dir, "ray", "session_*", "sockets"))


def test_ray_positions_resume_exactly(tmp_path, run_dir):
    path = write(random_batches(5, 20), tmp_path / "f.parquet")
    want = list(ParquetDataset(path, 15, seed=4, num_epochs=2))
    cut = random.randint(1, len(want) - 1)
    it = iter(_loader(path, 15, run_dir, seed=4, num_epochs=2))
    for _ in range(cut):
        next(it)
    position = json.loads(json.dumps(it.state_dict()))
    it.close()
    rest = list(_loader(path, 15, run_dir, seed=4, num_epochs=2, position=position))
    assert len(rest) == len(want) - cut
    for g, w in zip(rest, want[cut:]):
        assert_batches_equal(g, w)


def test_ray_task_errors_reach_the_trainer(tmp_path, run_dir):
    path = write(random_batches(2, 20), tmp_path / "f.parquet")
    loader = _loader(path, 20, run_dir, num_epochs=1)
    with open(path, "r+b") as f:  # the file changes after the footer was read
        f.truncate(os.path.getsize(path) // 3)
    with pytest.raises(DataFormatError, match=r"f\.parquet"):
        list(loader)


def test_close_mid_epoch_stops_ray_data_threads_before_shutdown(tmp_path, run_dir):
    # Last in the file: closing the loader that started Ray shuts that Ray down. Threads of an
    # iteration closed mid-epoch held ObjectRefs past ray.shutdown(), and Ray ended the process
    # when they were released (the trainer closes its endless loader mid-epoch, then evaluates).
    path = write(random_batches(4, 20), tmp_path / "f.parquet")
    if ray.is_initialized():
        ray.shutdown()
    loader = _loader(path, 10, run_dir)  # endless
    it = iter(loader)
    for _ in range(random.randint(1, 5)):
        next(it)
    it.close()
    loader.close()
    assert not ray.is_initialized()
    left = [t.name for t in threading.enumerate() if t.name in ("Prefetcher", "iter_threaded")]
    assert not left


def test_ray_loader_reads_a_read_time_table_as_the_local_loader(tmp_path, run_dir, seed):
    # A raw table with a join and a transform (recxla.data.read_time): each Ray task loads the
    # transform from its file and reads the feature table itself. After the test above shut
    # Ray down, this loader starts one of its own and closes it.
    import numpy as np
    import pyarrow.parquet as pq
    from test_data_read_time import click_log, user_features, write_transforms

    from recxla.data.read_time import ReadTimeTable

    rng = np.random.default_rng(seed)
    log = click_log(rng, 200)
    pq.write_table(log, tmp_path / "log.parquet", row_group_size=int(rng.integers(15, 30)))
    pq.write_table(user_features(rng, log), tmp_path / "users.parquet")
    table = ReadTimeTable(str(tmp_path / "log.parquet"),
                          joins=[f"user_id={tmp_path / 'users.parquet'}"],
                          transforms=[f"{write_transforms(tmp_path)}:engineer"])
    b = int(rng.integers(5, 20))
    kwargs = dict(seed=int(rng.integers(0, 99)), shuffle_rows=int(rng.integers(20, 60)),
                  num_epochs=2)
    loader = make_loader(table, b, loader="ray", num_workers=1, run_dir=run_dir, **kwargs)
    try:
        got = list(loader)
    finally:
        loader.close()
    want = list(make_loader(table, b, num_workers=1, **kwargs))
    assert len(got) == len(want) == loader.num_batches(0) + loader.num_batches(1)
    for g, w in zip(got, want):
        assert_batches_equal(g, w)
