"""make_loader and the local multi-process loader: the same batches as ParquetDataset, in the
same order, resumable across loaders; workers that end with the process that started them;
the CLI; the prefetching iterator."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from data_pipeline_cases import assert_batches_equal, random_batches, write

from recxla.data import LocalLoader, ParquetDataset, make_loader
from recxla.data.__main__ import main as cli_main
from recxla.data.batch_iterator import BatchIterator


@pytest.fixture
def dataset_path(tmp_path):
    # Row groups of uneven size (the last one short) and a batch size that does not divide them.
    batches = random_batches(5, 37) + random_batches(1, 20)
    return write(batches, tmp_path / "data", rows_per_file=80)


# Shuffle windows (row groups of 37 and 20 rows): none, one group, two groups, the default (all
# of a rank's groups). Batches straddle windows, so their pieces come from two workers.
WINDOWS = [0, 40, 80, None]


def _window(shuffle_rows) -> dict:
    return {} if shuffle_rows is None else {"shuffle_rows": shuffle_rows}


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("shuffle_rows", WINDOWS)
def test_local_loader_yields_the_dataset_batches(dataset_path, num_workers, shuffle_rows):
    b = random.randint(9, 30)
    kwargs = dict(rank=1, world_size=2, seed=random.randint(0, 99), **_window(shuffle_rows))
    want = list(ParquetDataset(dataset_path, b, num_epochs=2, **kwargs))
    loader = make_loader(dataset_path, b, num_workers=num_workers, num_epochs=2, **kwargs)
    assert isinstance(loader, LocalLoader)
    got = list(loader)
    assert len(got) == len(want) == loader.num_batches(0) + loader.num_batches(1)
    for g, w in zip(got, want):
        assert_batches_equal(g, w)


@pytest.mark.parametrize("shuffle_rows", [40, None])
def test_positions_resume_across_loaders(dataset_path, shuffle_rows):
    b = 16
    window = _window(shuffle_rows)
    want = list(ParquetDataset(dataset_path, b, num_epochs=3, seed=7, **window))
    cut = random.randint(1, len(want) - 1)
    it = iter(make_loader(dataset_path, b, seed=7, num_workers=2, num_epochs=3, **window))
    for _ in range(cut):
        next(it)
    position = json.loads(json.dumps(it.state_dict()))
    it.close()
    for workers in (0, 1):
        rest = list(make_loader(dataset_path, b, seed=7, num_workers=workers, num_epochs=3,
                                position=position, **window))
        assert len(rest) == len(want) - cut
        for g, w in zip(rest, want[cut:]):
            assert_batches_equal(g, w)


CONSUMER = """
import multiprocessing, sys, time
multiprocessing.set_start_method(sys.argv[2])  # what the workers are started with
from recxla.data import LocalLoader, ParquetDataset
loader = iter(LocalLoader(ParquetDataset(sys.argv[1], 4, num_epochs=None), num_workers=2))
next(loader)
print("ready", flush=True)
time.sleep(600)
"""


def _marked(mark: str) -> list:
    """The pids of the processes whose environment holds `mark`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark.encode() in f.read():
                    found.append(int(pid))
        except OSError:  # ended meanwhile, or not ours to read
            pass
    return found


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_workers_end_when_the_consumer_is_killed(dataset_path, start_method):
    """kill -9 of the process reading the loader ends its worker processes (and a forkserver
    that started them) within seconds: nothing outlives a killed rank, holding its sockets
    open. Forked workers are children of the consumer; a forkserver's are not, and torch's own
    parent check never sees the consumer go."""
    mark = f"RECXLA_LOADER_TEST={uuid.uuid4().hex}"
    env = dict(os.environ, RECXLA_LOADER_TEST_MARK=mark)
    consumer = subprocess.Popen([sys.executable, "-c", CONSUMER, str(dataset_path), start_method],
                                env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert consumer.stdout.readline().strip() == "ready"
        workers = [p for p in _marked(mark) if p != consumer.pid]
        assert len(workers) >= 2, workers  # 2 workers (and the forkserver)
    finally:
        consumer.send_signal(signal.SIGKILL)
        consumer.wait()
    deadline = time.monotonic() + 30
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _marked(mark)
    for pid in left:  # leave nothing behind, then fail
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} process(es) outlived the killed consumer"


def test_endless_loader_runs_past_one_epoch(dataset_path):
    loader = make_loader(dataset_path, 32, num_workers=1)
    it = iter(loader)
    n = loader.num_batches(0) + 2
    for _ in range(n):
        next(it)
    assert it.state_dict()["epoch"] == 1
    it.close()


def test_make_loader_arguments(dataset_path):
    with pytest.raises(ValueError, match="loader must be one of"):
        make_loader(dataset_path, 8, loader="spark")
    with pytest.raises(ValueError, match="num_workers must be an int >= 0"):
        make_loader(dataset_path, 8, num_workers=-1)
    with pytest.raises(ValueError, match="run_dir and ray_address apply to loader='ray'"):
        make_loader(dataset_path, 8, run_dir="/tmp/x")
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        make_loader(dataset_path, 0)
    with pytest.raises(ValueError, match="shuffle_rows must be an int >= 0"):
        make_loader(dataset_path, 8, shuffle_rows=-5)
    loader = make_loader(dataset_path, 8, num_workers=0)
    assert loader.metadata["layout"]["num_dense"] == 3


def test_prefetch_iterator_reraises_and_stops():
    def source():
        yield 0, 0, "a"
        yield 0, 1, "b"
        raise KeyError("boom")

    it = BatchIterator(source(), (0, 0), {"seed": 1}, prefetch=2)
    assert next(it) == "a" and next(it) == "b"
    assert it.state_dict() == {"format": "recxla.data.position", "seed": 1, "epoch": 0,
                               "batch": 2}
    with pytest.raises(KeyError, match="boom"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_closing_a_prefetch_iterator_stops_its_thread():
    def endless():
        k = 0
        while True:
            yield 0, k, k
            k += 1

    before = threading.active_count()
    it = BatchIterator(endless(), (0, 0), {}, prefetch=3)
    assert [next(it) for _ in range(5)] == list(range(5))
    it.close()
    assert threading.active_count() == before


def test_cli_write_and_info(tmp_path, capsys):
    out = str(tmp_path / "cli.parquet")
    args = ["write", "--out", out, "--batches", "2", "--batch-size", "300", "--max-rows",
            "2000", "--sort-by", "cat_2"]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert "wrote 600 rows" in printed and "sorted by cat_2" in printed
    assert "unsorted layout:" in printed
    assert cli_main(args) == 2  # exists already
    assert "overwrite" in capsys.readouterr().err
    assert cli_main(["info", out]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["rows"] == 600 and info["sort_by"] == "cat_2"
    assert info["layout"]["features"] == [f"cat_{i}" for i in range(26)]
    ds = ParquetDataset(out, 300)
    from recxla.data import embedding_bag_configs

    ds.check_tables(embedding_bag_configs(max_rows=2000), num_dense=13)
