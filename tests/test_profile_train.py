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


def test_kernel_times_record_each_recxla_call_and_time_it_again_on_copies(seed):
    from bench.profile_train import _KernelTimes, kernel_table
    from recxla.copy_runs_layout import Run, pack
    from recxla.ops.copy_runs import copy_runs

    rows, width = random.randint(2, 40), random.randint(1, 64)
    source = torch.randn(rows * width)
    target = torch.zeros(rows * width)
    runs = pack([Run(0, 0, width, 0, 0, width, rows, width)])
    recorder = _KernelTimes(repeats=3)
    recorder.start()
    try:
        copy_runs([source], [target], runs)
        copy_runs([source], [target], runs)
        scaled = source * 2  # an ATen op: not recorded
    finally:
        recorder.stop()
    assert torch.equal(target, source) and torch.equal(scaled, source * 2)
    # Outside start() / stop() nothing is recorded.
    copy_runs([source], [target], runs)
    [row] = recorder.counts
    assert row["op"] == "recxla::copy_runs" and row["calls"] == 2
    assert all(row[key] >= 0.0 for key in ("in_step", "warm", "cold"))
    lines = kernel_table(recorder.counts, steps=2).splitlines()
    assert lines[2].startswith("| `recxla::copy_runs` | 1 |")
    assert lines[3].startswith("| `all` | 1 |") and len(lines) == 4


def test_kernel_times_run_on_copies_of_the_arguments(seed):
    from bench.profile_train import _copied, time_alone

    x = torch.randn(random.randint(1, 100))
    args = ([x, (x, 3)], "name")
    copied = _copied(args)
    assert copied[1] == "name" and copied[0][1][1] == 3
    assert torch.equal(copied[0][0], x) and copied[0][0].data_ptr() != x.data_ptr()
    seen = []

    def add_one(values, _name):  # writes into its argument, as *_out ops do
        values[0].add_(1.0)
        seen.append(values[0].clone())

    evictions = []
    assert time_alone(add_one, args, {}, repeats=3, evict=lambda: evictions.append(1)) >= 0
    # Every run started from the arguments as given, and the originals are untouched.
    assert len(seen) == 3 and all(torch.equal(s, x + 1.0) for s in seen)
    assert len(evictions) == 3 and torch.equal(args[0][0], x)


def test_python_times_count_each_function_and_its_own_time(seed):
    from bench.profile_train import _origin, _PythonTimes, python_table

    calls = random.randint(2, 30)

    def busy(n):
        return sum(range(n))

    recorder = _PythonTimes()
    recorder.start()
    try:
        for _ in range(calls):
            busy(2000)
    finally:
        recorder.stop()
    busy(10)  # after stop(): not counted
    rows = {r["function"]: r for r in recorder.counts}
    [name] = [f for f in rows if f.endswith("(busy)")]
    assert rows[name]["calls"] == calls and rows[name]["own"] >= 0.0
    assert rows[name]["with_callees"] >= rows[name]["own"]
    assert rows["<built-in method builtins.sum>"]["calls"] == calls
    assert _origin("<built-in method builtins.sum>") == "C"
    assert _origin("recxla/pipeline/window.py:1(f)") == "recxla/pipeline"
    assert _origin("torchrec/models/dlrm.py:2(g)") == "torchrec"
    table = python_table(recorder.counts, steps=calls, n=2).splitlines()
    assert table[0].startswith("All functions' own time: ") and len(table) == 6
    assert all(line.startswith("| `") for line in table[4:])


def test_python_side_by_side_sums_each_path_by_part(seed):
    from bench.profile_train import PYTHON_PARTS, python_side_by_side

    steps = random.randint(1, 5)
    own = {f: random.uniform(0.001, 0.01) for f in (
        "<built-in method torch.cat>", "recxla/pipeline/window.py:1(a)",
        "recxla/data/synthetic.py:2(b)", "torchrec/models/dlrm.py:3(c)",
        "fbgemm_gpu/x.py:4(d)", "tests/t.py:5(e)")}
    rows = [{"function": f, "calls": 2 * steps, "own": t, "with_callees": t}
            for f, t in own.items()]
    lines = python_side_by_side([("dbp", rows, steps),
                                 ("torchrec", "rank 0 exited with code 1", 0)]).splitlines()
    assert lines[0] == "| ms a step | dbp | torchrec |"
    by_part = {line.split(" | ")[0][2:]: line.split(" | ")[1] for line in lines[2:]}

    def ms(*functions):
        return f"{sum(own[f] for f in functions) * 1e3 / steps:.1f}"

    assert by_part[PYTHON_PARTS[0]] == ms("<built-in method torch.cat>")
    assert by_part[PYTHON_PARTS[1]] == ms("recxla/pipeline/window.py:1(a)")
    assert by_part[PYTHON_PARTS[2]] == ms("torchrec/models/dlrm.py:3(c)", "fbgemm_gpu/x.py:4(d)")
    assert by_part[PYTHON_PARTS[3]] == ms("recxla/data/synthetic.py:2(b)")
    assert by_part[PYTHON_PARTS[4]] == ms("tests/t.py:5(e)")
    assert by_part["all"] == ms(*own)
    assert by_part["Python calls a step"] == f"{2 * len(own):,.0f}"
    assert "failed: rank 0 exited with code 1" in lines[2]
