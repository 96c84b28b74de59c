"""Steady state: after warm-up a training step maps no new memory in (minor page faults per
step, counted by the trainer on every rank), while the same run with glibc's initial thresholds
page-faults its large tensors in again every step.

The control holds glibc's thresholds at their initial values (GLIBC_TUNABLES) rather than
leaving them to adapt: glibc raises its mmap threshold to the size of each mmap()ed block freed
so far, so with the defaults how many of a step's blocks come back from the kernel depends on
the order in which threads free them, and varies from run to run on the same commit (p50 from
853 to 9,743 faults per step; with the thresholds held, 27,800 to 28,200, under any load)."""

import json

from test_train_cli import launch_ranks

from recxla.train.memory import minor_faults

# Large enough tensors that a fresh allocation per step shows: the pooled embeddings alone are
# 2048 x 26 x 32 float32 = 6.8 MB (1,664 pages) per rank.
ARGS = ["--profile", "small", "--batch-size", "2048", "--embedding-dim", "32",
        "--dense-arch", "64", "--over-arch", "64", "--eval-batches", "1", "--no-progress",
        "--steps", "16", "--warmup-steps", "6"]


POOLED_EMBEDDING_PAGES = 2048 * 26 * 32 * 4 // 4096
# glibc's initial thresholds (128 KiB), set explicitly: a set threshold no longer adapts.
FIXED_THRESHOLDS = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072:"
                                      "glibc.malloc.trim_threshold=131072"}


def _faults(tmp_path, allocator: str, env=None) -> dict:
    path = tmp_path / f"{allocator}.json"
    launch_ranks([*ARGS, "--allocator", allocator, "--metrics", str(path)], tmp_path, env=env)
    with open(path) as f:
        return json.load(f)["page_faults_per_step"]


def test_steady_state_maps_no_new_memory(tmp_path):
    kept = _faults(tmp_path, "keep")
    control = _faults(tmp_path, "default", env=FIXED_THRESHOLDS)
    # The setup allocates large blocks per step: every block above 128 KiB is a fresh mapping,
    # the pooled embeddings among them.
    assert control["p50"] >= POOLED_EMBEDDING_PAGES, control
    assert kept["p50"] <= 64, kept  # at most 256 KiB of fresh pages in a typical step
    assert kept["mean"] <= control["mean"] / 10, (kept, control)


def test_minor_faults_counts_first_touch():
    import torch

    before = minor_faults()
    block = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB: above every mmap threshold
    block.fill_(1)
    assert minor_faults() - before >= (64 << 20) // 4096 // 2  # 4 KiB pages (or fewer huge)
