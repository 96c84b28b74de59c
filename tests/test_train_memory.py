"""Steady state: after warm-up a training step maps no new memory in (minor page faults per
step, counted by the trainer on every rank), while the same run with glibc's default
thresholds page-faults its large tensors in again every step."""

import json

from test_train_cli import launch_ranks

from recxla.train.memory import minor_faults

# Large enough tensors that a fresh allocation per step shows: the pooled embeddings alone are
# 2048 x 26 x 32 float32 = 6.8 MB (1,664 pages) per rank.
ARGS = ["--profile", "small", "--batch-size", "2048", "--embedding-dim", "32",
        "--dense-arch", "64", "--over-arch", "64", "--eval-batches", "1", "--no-progress",
        "--steps", "16", "--warmup-steps", "6"]


def _faults(tmp_path, allocator: str) -> dict:
    path = tmp_path / f"{allocator}.json"
    launch_ranks([*ARGS, "--allocator", allocator, "--metrics", str(path)], tmp_path)
    with open(path) as f:
        return json.load(f)["page_faults_per_step"]


def test_steady_state_maps_no_new_memory(tmp_path):
    kept = _faults(tmp_path, "keep")
    default = _faults(tmp_path, "default")
    assert default["p50"] >= 1000, default  # the setup does allocate large blocks per step
    assert kept["p50"] <= 64, kept  # at most 256 KiB of fresh pages in a typical step
    assert kept["mean"] <= default["mean"] / 10, (kept, default)


def test_minor_faults_counts_first_touch():
    import torch

    before = minor_faults()
    block = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB: above every mmap threshold
    block.fill_(1)
    assert minor_faults() - before >= (64 << 20) // 4096 // 2  # 4 KiB pages (or fewer huge)
