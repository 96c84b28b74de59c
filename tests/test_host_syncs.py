"""The step's host reads (docs/gpu.md, "Host reads of a steady step"): what bench.profile_train
--host-syncs counts, and a 2-rank trainer run whose every read site is in the docs' table, at
no more calls a step than its ceiling there."""

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from bench.profile_train import _HostSyncs, sync_sites

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\| `([^`]+)` \| `([^`]+)` \| (\d+) \| (host|device) \|")


def documented() -> dict:
    """{(site, op): ceiling a step} of the table in docs/gpu.md."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    section = text.split("### Host reads of a steady step", 1)[1].split("\n## ", 1)[0]
    rows = {(m[1], m[2]): int(m[3]) for m in map(ROW.match, section.splitlines()) if m}
    assert rows, "docs/gpu.md lists no host reads"
    return rows


def _reads(x, mask):
    x.sum().item()
    x.nonzero()
    x[mask]
    x.repeat_interleave(torch.tensor([1] * x.numel()))
    x.repeat_interleave(torch.tensor([2] * x.numel()), output_size=2 * x.numel())
    x.repeat_interleave(2)
    (x + 1).tolist()


def test_counts_what_reads_values_back(seed):
    x = torch.randn(int(torch.randint(2, 40, ())))
    counter = _HostSyncs()
    counter.start()
    try:
        _reads(x, x > 0)
    finally:
        counter.stop()
    here = "tests/test_host_syncs.py:_reads"
    assert counter.counts == Counter({(here, "_local_scalar_dense"): 1, (here, "nonzero"): 1,
                                      (here, "index (mask)"): 1,
                                      (here, "repeat_interleave"): 1, (here, "tolist"): 1})
    assert torch.Tensor.tolist is counter._tolist  # restored
    assert sync_sites(counter.counts, 2)[(here, "nonzero")] == 0.5


@pytest.mark.distributed
def test_steady_step_reads_no_more_than_documented():
    argv = [sys.executable, "-m", "bench.profile_train", "--schedule", "dbp", "--ranks", "2",
            "--steps", "10", "--warmup", "3", "--host-syncs"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = {}
    for line in done.stdout.splitlines():
        m = re.match(r"^\| `([^`]+)` \| `([^`]+)` \| ([\d.]+) \|$", line)
        if m:
            measured[(m[1], m[2])] = float(m[3])
    assert measured, done.stdout[-3000:]
    allowed = documented()
    unlisted = sorted(set(measured) - set(allowed))
    assert not unlisted, f"host reads not in docs/gpu.md's table: {unlisted}"
    over = {key: (calls, allowed[key]) for key, calls in measured.items()
            if calls > allowed[key]}
    assert not over, f"more host reads a step than docs/gpu.md allows: {over}"
