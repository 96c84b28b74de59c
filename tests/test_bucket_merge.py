"""The choice of how a step sends its dense buckets (recxla.pipeline.bucket_merge): the tuner
measures both ways in blocks, keeps the faster by median step time and measures again later;
steps right after a change of way are left out; bad settings are refused by name. The
distributed side (the choice carried in the sums, the same bits either way) is in
tests/test_dense_sync.py."""

import random
from types import SimpleNamespace

import pytest

from recxla.pipeline.bucket_merge import MergeTuner, bits_independent_of_grouping


def _run(tuner, step_time, steps):
    """Drives `tuner` as MicroBatchGradientSync does: each step's way is the proposal made
    `tuner.lag` steps before (the first steps go apart), and each step's time
    step_time(step, way) is recorded at the next step's begin, before its proposal."""
    ways, proposals = [], [False] * tuner.lag
    for _ in range(steps):
        if ways:
            tuner.record(step_time(len(ways) - 1, ways[-1]), ways[-1],
                         len(ways) < 2 or ways[-2] == ways[-1])
        proposals.append(tuner.propose())
        ways.append(proposals.pop(0))
    return ways


@pytest.mark.parametrize("lag", [0, 1, 2])
@pytest.mark.parametrize("together_faster", [True, False])
def test_tuner_keeps_the_faster_way_then_measures_again(seed, together_faster, lag):
    block, rounds, recheck = random.randint(2, 6), random.randint(1, 3), random.randint(5, 20)
    tuner = MergeTuner(block=block, rounds=rounds, recheck=recheck, lag=lag)
    fast, slow = 0.08, 0.10

    def step_time(step, merged):
        base = fast if merged == together_faster else slow
        return base * random.uniform(0.99, 1.01)

    measuring = 2 * block * rounds
    plan = [m for _ in range(rounds) for m in (False, True) for _ in range(block)]
    ways = _run(tuner, step_time, lag + 2 * (measuring + lag + recheck))
    # The measurement's blocks of each way in turn, `lag` steps late; the last block goes on
    # until its last step is timed; then the faster way for `recheck` steps, and again.
    once = plan + [True] * lag + [together_faster] * recheck
    assert ways == [False] * lag + once + once, ways
    assert tuner.chosen == together_faster and tuner.measurements == 2


def test_tuner_counts_only_the_steps_it_proposed_for_the_measurement():
    # The first measurement finds together faster; the second, apart. The steps outside the
    # measurements (together, fast) are still being timed when the second one starts: counted,
    # they would make together look faster again.
    block, recheck = random.randint(2, 4), random.randint(2, 5)
    tuner = MergeTuner(block=block, rounds=1, recheck=recheck, lag=1)
    first = range(1, 1 + 2 * block)
    second = range(first.stop + 1 + recheck, first.stop + 1 + recheck + 2 * block)

    def step_time(step, merged):
        if step in first:
            return 0.08 if merged else 0.10
        if step in second:
            return 0.10 if merged else 0.08
        return 0.001

    _run(tuner, step_time, second.stop + 2)
    assert tuner.measurements == 2 and tuner.chosen is False


def test_tuner_leaves_out_the_step_after_a_change():
    tuner = MergeTuner(block=2, rounds=1, recheck=1)
    # Steps 1-2 apart, 3-4 together: step 3 also waited for step 2's sum and took long; left
    # out, together stays faster.
    ways = _run(tuner, lambda step, merged: 9.0 if step == 3 else (0.05 if merged else 0.1), 7)
    assert ways == [False, False, False, True, True, True, True] and tuner.chosen


def test_tuner_without_both_ways_measured_sends_apart():
    tuner = MergeTuner(block=2, rounds=1, recheck=2)
    # No step timed: the planned blocks, the last one's wait, then apart until measuring again.
    assert [tuner.propose() for _ in range(9)] == [False, False, True, True, True, False, False,
                                                   False, False]
    assert tuner.measurements == 1 and not tuner.chosen


def test_tuner_refuses_bad_settings():
    for kwargs, message in (({"block": 1}, "block must be an int >= 2, got 1"),
                            ({"rounds": 0}, "rounds must be an int >= 1, got 0"),
                            ({"recheck": 2.5}, "recheck must be an int >= 1, got 2.5"),
                            ({"block": True}, "block must be an int >= 2, got True")):
        with pytest.raises(ValueError, match=message):
            MergeTuner(**kwargs)


def test_only_sums_whose_bits_cannot_change_are_tuned():
    # No process group is consulted before the layout and the wire qualify.
    assert not bits_independent_of_grouping(None, "bf16")
    three = SimpleNamespace(num_nodes=3, shard_group=None, replica_group=None)
    assert not bits_independent_of_grouping(three, "fp32")
    two = SimpleNamespace(num_nodes=2, shard_group=None, replica_group=None)
    assert not bits_independent_of_grouping(two, "fp8")
    assert not bits_independent_of_grouping(two, "powersgd")


def test_dense_allreduce_refuses_bad_bucket_merge():
    from recxla.pipeline import DenseAllReduce

    assert DenseAllReduce("bf16").bucket_merge == "auto"
    with pytest.raises(ValueError, match="bucket_merge must be one of"):
        DenseAllReduce("bf16", bucket_merge="always")
    with pytest.raises(ValueError, match="bucket_merge='on' applies to the fp32 and bf16 wires"):
        DenseAllReduce("fp8", bucket_merge="on")
    assert DenseAllReduce("powersgd", bucket_merge="off").bucket_merge == "off"
