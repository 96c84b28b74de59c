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
    """Drives `tuner` as MicroBatchGradientSync does: each step's way is the proposal made two
    steps before (the first two go apart), its time step_time(way)."""
    ways, proposals = [], [False, False]
    for _ in range(steps):
        way = proposals.pop(0)
        if ways:
            tuner.record(step_time(ways[-1]), ways[-1], len(ways) < 2 or ways[-2] == ways[-1])
        proposals.append(tuner.propose())
        ways.append(way)
    return ways


@pytest.mark.parametrize("together_faster", [True, False])
def test_tuner_keeps_the_faster_way_then_measures_again(seed, together_faster):
    block, rounds, recheck = random.randint(3, 6), random.randint(1, 3), random.randint(5, 20)
    tuner = MergeTuner(block=block, rounds=rounds, recheck=recheck)
    fast, slow = 0.08, 0.10

    def step_time(merged):
        base = fast if merged == together_faster else slow
        return base * random.uniform(0.99, 1.01)

    measuring = 2 * block * rounds
    ways = _run(tuner, step_time, 2 + measuring + recheck + measuring)
    # The measurement: blocks of each way in turn, a step late.
    assert ways[2:2 + measuring] == [m for _ in range(rounds) for m in (False, True)
                                     for _ in range(block)]
    # Then the faster way for `recheck` steps, then the blocks again.
    chosen = ways[2 + measuring: 2 + measuring + recheck]
    assert chosen == [together_faster] * recheck, ways
    assert ways[2 + measuring + recheck: 2 + measuring + recheck + block] == [False] * block
    assert tuner.chosen == together_faster and tuner.measurements >= 1


def test_tuner_leaves_out_the_step_after_a_change():
    tuner = MergeTuner(block=2, rounds=1, recheck=1)
    # A step after a change of way that took long must not count: together stays faster.
    for seconds, merged, after_same in ((0.1, False, True), (0.1, False, True),
                                        (9.0, True, False), (0.05, True, True)):
        tuner.record(seconds, merged, after_same)
    for _ in range(4):
        tuner.propose()
    assert tuner.propose() is True and tuner.chosen


def test_tuner_without_both_ways_measured_sends_apart():
    tuner = MergeTuner(block=2, rounds=1, recheck=2)
    tuner.record(0.01, True, True)  # only one way measured
    assert [tuner.propose() for _ in range(6)] == [False, False, True, True, False, False]


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
