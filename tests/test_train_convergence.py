"""Quantized communication trains like fp32 communication: after the same steps on the same
data, plan and initial weights, e4m3 forward with bf16 backward reaches the AUC and held-out
loss of fp32 all-to-alls (a cheap version of the measured note in bench/results/training.md,
which checks the 0.002 AUC bound on a larger run)."""

import json

import pytest
from test_train_cli import SMALL, launch_ranks

RUN = [*SMALL, "--batch-size", "256", "--steps", "40", "--warmup-steps", "2",
       "--eval-batches", "8"]


def _run(tmp_path, fwd: str, bwd: str) -> dict:
    path = tmp_path / f"{fwd}_{bwd}.json"
    launch_ranks([*RUN, "--fwd-comm", fwd, "--bwd-comm", bwd, "--metrics", str(path)], tmp_path)
    with open(path) as f:
        return json.load(f)


def test_e4m3_bf16_trains_like_fp32(tmp_path):
    ref = _run(tmp_path, "fp32", "fp32")
    fp8 = _run(tmp_path, "e4m3", "bf16")
    assert ref["auc"] > 0.6  # 40 steps did learn something: the comparison means something
    assert abs(fp8["auc"] - ref["auc"]) <= 0.01, (fp8["auc"], ref["auc"])
    assert abs(fp8["eval_loss"] - ref["eval_loss"]) <= 0.01, (fp8["eval_loss"], ref["eval_loss"])
    # ... sending e4m3 rows of 16 codes + a 4-byte scale where fp32 sends 64 bytes
    fwd = lambda m: m["wire_bytes_per_step_by_kind"]["embeddings_fwd"]  # noqa: E731
    assert fwd(fp8) == pytest.approx(fwd(ref) * (16 + 4) / (16 * 4))
