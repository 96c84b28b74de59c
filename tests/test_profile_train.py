"""bench.profile_train's ATen call counter (--calls-by-line): every ATen call is counted once,
by the innermost line outside torch that made it, forward and backward; the table lists the
lines with the most calls first, after the total split into the step's own calls and the
synthetic batches' making."""

import inspect
import random

import torch

from bench.profile_train import _CallsByLine, top_lines


def _three_calls(x):
    y = x * 2  # one aten::mul
    return y.sum() + x.sum()  # two aten::sum, one aten::add


def test_calls_are_counted_by_the_line_that_made_them(seed):
    x = torch.randn(int(torch.randint(3, 50, ())), requires_grad=True)
    counter = _CallsByLine()
    first = inspect.getsourcelines(_three_calls)[1]
    here = f"tests/test_profile_train.py:{first + 1}"
    there = f"tests/test_profile_train.py:{first + 2}"
    counter.start()
    try:
        out = _three_calls(x)
        backward_line = inspect.currentframe().f_lineno + 1
        out.backward()
    finally:
        counter.stop()
    counts = {k.replace("\\", "/"): v for k, v in counter.counts.items()}
    assert counts[here] == 1 and counts[there] == 3, counts
    # The backward's kernels are made by the line that called backward().
    assert counts[f"tests/test_profile_train.py:{backward_line}"] >= 2, counts
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    # Outside start() / stop() nothing is counted.
    before = sum(counter.counts.values())
    _three_calls(x)
    assert sum(counter.counts.values()) == before


def test_table_lists_the_most_calls_first():
    from collections import Counter

    table = top_lines(Counter({"a.py:1": 30, "b.py:2": 90, "recxla/data/world.py:3": 6}),
                      steps=3, n=2)
    lines = table.splitlines()
    # The synthetic batches' making (recxla/data/) apart from the step's own calls.
    assert lines[0] == ("all ATen calls: 42 a step: the step's own 40, the synthetic batches' "
                        "making (recxla/data/) 2")
    assert lines[4].startswith("| `b.py:2` | 30.0 |") and lines[5].startswith("| `a.py:1` | 10.0 |")
    assert len(lines) == 6


def test_side_by_side_table_splits_each_path():
    from collections import Counter

    from bench.profile_train import side_by_side

    own, data, steps = random.randint(51, 500), random.randint(0, 50), random.randint(1, 9)
    results = [("dbp", Counter({"recxla/pipeline/window.py:1": own * steps,
                                "recxla/data/world.py:3": data * steps}), steps),
               ("torchrec", Counter({"torchrec/x.py:2": 2 * own * steps}), steps),
               ("dense-floor", "rank 0 exited with code 1", 0)]
    lines = side_by_side(results).splitlines()
    assert lines[2] == f"| dbp | {own} | {data} |"
    assert lines[3] == f"| torchrec | {2 * own} | 0 |"
    assert lines[4] == "| dense-floor | failed: rank 0 exited with code 1 | |"
    # The shares of the per-line table stay shares of all calls.
    table = top_lines(results[0][1], steps, 1).splitlines()
    assert table[4].endswith(f"| {own / (own + data):.1%} |")
