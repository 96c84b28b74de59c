"""FP16 tables' float16 copies (recxla/torchrec/fp16_tables.py): what state_dict hands out is
live, as TorchRec's float16 weights are. Whole-module behaviour against TorchRec's sharder:
tests/test_dropin_inputs.py::test_fp16_tables_as_torchrec and TorchRec's own harness
(tests/test_torchrec_suite.py)."""

import torch

from recxla.torchrec.fp16_tables import Float16Copies, RoundUpdatedRows


def _shards():
    weights = {0: torch.nn.Parameter(torch.randn(7, 3).half().float()),
               2: torch.nn.Parameter(torch.randn(5, 4).half().float())}
    return weights, Float16Copies(weights)


def test_copies_start_equal_and_take_writes_from_either_side():
    weights, copies = _shards()
    for lt, weight in weights.items():
        assert copies.halves[lt].dtype == torch.float16
        assert torch.equal(copies.halves[lt].float(), weight.detach())
    # A write into the float16 copy (state_dict's tensor) reaches the shard the kernels read.
    written = torch.randn(7, 3).half()
    copies.halves[0].copy_(written)
    version = copies.versions()
    copies.sync()
    assert torch.equal(weights[0].detach(), written.float())
    # A write into the float32 shard is rounded to float16 and shows in the copy.
    raw = torch.randn(5, 4)
    with torch.no_grad():
        weights[2].copy_(raw)
    copies.sync()
    assert torch.equal(weights[2].detach(), raw.half().float())
    assert torch.equal(copies.halves[2], raw.half())
    # Both written: the float16 side (state_dict's tensor) wins.
    with torch.no_grad():
        weights[0].add_(1.0)
    copies.halves[0].zero_()
    copies.sync()
    assert torch.equal(weights[0].detach(), torch.zeros(7, 3))
    assert copies.versions() != version  # a write to the copies changes the tables' version
    # Nothing written since: sync leaves both as they are.
    before = [w.detach().clone() for w in weights.values()]
    copies.sync()
    assert all(torch.equal(w.detach(), b) for w, b in zip(weights.values(), before))


def test_round_updated_rows_writes_both_sides():
    weights, copies = _shards()
    # Local tables 0 (FP16), 1 (FP32) and 2 (FP16); the fused update changed rows 1, 4 of
    # table 0 and row 3 of table 2 (float32 values, not float16 ones).
    unique_values = torch.tensor([1, 4, 0, 3])
    unique_offsets = torch.tensor([0, 2, 3, 4])
    with torch.no_grad():
        weights[0][1:5:3] += torch.randn(2, 3) * 1e-3
        weights[2][3] += torch.randn(4) * 1e-3
    updated = [weights[0].detach().clone(), weights[2].detach().clone()]
    other = torch.randn(2, 2)
    RoundUpdatedRows(copies)([weights[0], other, weights[2]], unique_values, unique_offsets)
    for lt, want in zip((0, 2), updated):
        assert torch.equal(weights[lt].detach(), want.half().float())
        assert torch.equal(copies.halves[lt], want.half())
    # Both sides were written by the update: sync sees nothing left to take.
    copies.sync()
    for lt, want in zip((0, 2), updated):
        assert torch.equal(weights[lt].detach(), want.half().float())
