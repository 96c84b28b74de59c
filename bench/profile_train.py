"""Where one rank's training step spends CPU: recxla-train on one rank, under torch.profiler.

    python -m bench.profile_train --schedule sequential --steps 30
    python -m bench.profile_train --schedule fwp-dbp-m2 -- --threads 1   # trainer options after --
    python -m bench.profile_train --ranks 4 -- --threads 1 --sparse-optimizer sgd

    python -m bench.profile_train --ranks 4 --calls-by-line -- --dense-allreduce powersgd
    python -m bench.profile_train --ranks 2 --steps 23 --warmup 3 --side-by-side

Runs `recxla-train` in this process as a job of one rank (no communication leaves the process),
the trainer's default model and options plus the schedule's flags, and profiles the steps after
warm-up (record_shapes off). With --ranks N it runs N processes over loopback and profiles rank
0: its codec, row exchange and gloo work included (the ranks share this machine's cores, so read
the CPU shares, not the wall time). Prints the top operators and labelled ranges by self CPU
time: their share of all self CPU time recorded, milliseconds and calls per step. The
profiler's own cost inflates ops with many small calls; read the shares, not the absolute
times.

With --calls-by-line it counts ATen calls instead (a TorchDispatchMode over the same steps on
rank 0, forward and backward): per step, by the innermost line of Python that made them outside
torch itself (recxla's, TorchRec's, the model's), the lines with the most calls first. On a CPU
every such call costs a few microseconds of dispatch whatever its size, and on a GPU it is a
kernel launch: this says which lines to batch. With --side-by-side it counts them for recxla's
default schedule, TorchRec's pipeline and the dense floor (TorchRec's pipeline on fixed pooled
embeddings: the model's own calls) in turn, and prints one table of the three.

With --host-syncs it counts the step's calls that read a tensor's values back to the host, or
whose result's size depends on its values (on a GPU each waits for the device): ATen's
_local_scalar_dense (`item()`, `int(t)`, ...), nonzero, masked_select, unique, bincount,
equal, is_nonzero, repeat_interleave without output_size, indexing by a boolean mask, and
Tensor.tolist; by the site that made them (path and function of the innermost caller outside
torch, rank 0, the synthetic batches' making left out). docs/gpu.md lists each site with why
it stays; tests/test_host_syncs.py holds the step to that list.

With --kernel-times it records every call of a recxla op (`torch.ops.recxla.*`) that rank 0's
measured steps make, with a copy of its arguments and the CPU time it took in the step (the
calling thread: run the trainer with --threads 1), then runs each call again alone on fresh
copies: warm (repeated, so its data stays in cache) and cold (twice the last-level cache
written before each run). The table gives each op's milliseconds a step in the three settings:
how far the step runs its kernels from their warm speed (the pytest benchmarks' setting), and
whether the cold one accounts for the gap. Two measured steps are enough (the run's last step
loads no next batch, so --steps WARMUP + 2); the recording, a dispatch mode over every op and a
copy of each recxla call's arguments, adds time between the ops, not in them.

    python -m bench.profile_train --ranks 2 --steps 22 --warmup 20 --schedule dbp \\
        --kernel-times -- --threads 1

With --python-times it runs cProfile over rank 0's measured steps (its main thread: the step;
the batch worker's thread is not counted) and lists the Python functions, and the C functions
they call, with the most own time: what a step spends in the interpreter by function, the
part of the CPU above the dense floor that no kernel accounts for. cProfile's own cost
inflates functions with many small calls (about a microsecond a call here); compare the
shares and the calls, and time a change with the trainer itself.

    python -m bench.profile_train --ranks 2 --steps 40 --warmup 20 --schedule dbp \\
        --python-times --top 40 -- --threads 1

With --side-by-side as well it does that for recxla's default schedule, TorchRec's pipeline and
the dense floor in turn, and prints one table of their own time by part (built-ins, recxla's
Python, TorchRec's and torch's, the synthetic batches).
"""

import argparse
import multiprocessing
import os
import socket
import sys
from collections import Counter
from typing import List

SCHEDULES = {
    "sequential": ["--micro-batches", "1", "--no-overlap", "--no-dbp"],
    "dbp": ["--micro-batches", "1"],
    "fwp-dbp-m2": ["--micro-batches", "2"],
    "torchrec": ["--baseline", "torchrec"],
    # TorchRec's pipeline on fixed pooled embeddings: the dense work alone (the cluster
    # benchmark's "dense floor").
    "dense-floor": ["--baseline", "torchrec", "--dense-floor"],
}
# --side-by-side: recxla's default schedule, TorchRec's, and the dense floor.
SIDE_BY_SIDE = ("dbp", "torchrec", "dense-floor")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _CallsByLine:
    """Counts ATen calls by the innermost caller outside torch's own package while active
    (start / stop, as torch.profiler.profile): `counts` maps "path:line" (relative to
    site-packages or to this repository) to calls."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        torch_dir = os.path.dirname(torch.__file__) + os.sep
        this_file = os.path.abspath(__file__)
        counts = self.counts = Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                frame = sys._getframe(1)
                while frame is not None and (frame.f_code.co_filename.startswith(torch_dir)
                                             or frame.f_code.co_filename == this_file):
                    frame = frame.f_back
                where = "(torch only)" if frame is None else \
                    f"{_short_path(frame.f_code.co_filename)}:{frame.f_lineno}"
                counts[where] += 1
                return func(*args, **(kwargs or {}))

        self._mode = Mode()

    def start(self) -> None:
        self._mode.__enter__()

    def stop(self) -> None:
        self._mode.__exit__(None, None, None)


# ATen ops that read values back to the host or size their result by the values.
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2",
            "unique_dim", "unique_consecutive", "unique_dim_consecutive", "bincount", "equal",
            "is_nonzero"}


def sync_op(func, args, kwargs) -> str:
    """The name of ATen op `func` when the call reads values back or sizes its result by them
    (see SYNC_OPS and the module docstring), else ""."""
    import torch

    name = func._schema.name.split("::")[-1]
    if name in SYNC_OPS:
        return name
    if name == "repeat_interleave" and func._overloadname != "self_int" and \
            (kwargs or {}).get("output_size") is None:
        return name
    if name == "index" and len(args) > 1 and any(
            getattr(i, "dtype", None) in (torch.bool, torch.uint8) for i in args[1]):
        return "index (mask)"
    return ""


class _HostSyncs:
    """Counts the calls sync_op names, and Tensor.tolist, by site ("path:function" of the
    innermost caller outside torch) and op while active (start / stop): `counts` maps
    (site, op) to calls."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        torch_dir = os.path.dirname(torch.__file__) + os.sep
        this_file = os.path.abspath(__file__)
        counts = self.counts = Counter()

        def site() -> str:
            frame = sys._getframe(2)
            while frame is not None and (frame.f_code.co_filename.startswith(torch_dir)
                                         or frame.f_code.co_filename == this_file):
                frame = frame.f_back
            return "(torch only)" if frame is None else \
                f"{_short_path(frame.f_code.co_filename)}:{frame.f_code.co_name}"

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                op = sync_op(func, args, kwargs)
                if op:
                    counts[(site(), op)] += 1
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._tolist = torch.Tensor.tolist

        def tolist(tensor):
            counts[(site(), "tolist")] += 1
            return self._tolist(tensor)

        self._counting_tolist = tolist

    def start(self) -> None:
        import torch

        torch.Tensor.tolist = self._counting_tolist
        self._mode.__enter__()

    def stop(self) -> None:
        import torch

        self._mode.__exit__(None, None, None)
        torch.Tensor.tolist = self._tolist


# --kernel-times: how far the step's own recxla ops run from the same calls alone.
KERNEL_NAMESPACE = "recxla"
KERNEL_REPEATS = 7


def _copied(value):
    """value with every tensor in it cloned (lists and tuples followed): a call's arguments,
    kept past the step and given afresh to each timed run (some ops write into them)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


def evict_bytes() -> int:
    """Bytes written between the cold runs: twice the last-level cache the OS reports, at
    least 256 MB and at most 1 GB (a VM may report a cache it shares)."""
    try:
        cache = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError):
        cache = 0
    return min(max(2 * max(cache, 0), 256 << 20), 1 << 30)


def time_alone(func, args, kwargs, repeats: int, evict=None) -> float:
    """Median CPU seconds (this thread) of func on fresh copies of args and kwargs, the
    copies made outside the timing; evict(), if given, runs before each call (a cold cache)."""
    import time

    times = []
    for _ in range(repeats):
        a, k = _copied(args), _copied(kwargs)
        if evict is not None:
            evict()
        start = time.thread_time()
        func(*a, **k)
        times.append(time.thread_time() - start)
    times.sort()
    return times[len(times) // 2]


class _KernelTimes:
    """While active (start / stop), records every call of a recxla op with a copy of its
    arguments and the CPU time it took there (this thread); stop() then runs each recorded
    call again alone, warm (the call repeated) and cold (evict_bytes() written before each
    run), and `counts` holds a row per op: name, calls, seconds in the step, alone warm,
    alone cold (totals over the recorded calls)."""

    def __init__(self, repeats: int = KERNEL_REPEATS):
        import time

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        calls = self.calls = []
        self.repeats = repeats
        self.counts: List[dict] = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func.namespace != KERNEL_NAMESPACE:
                    return func(*args, **kwargs)
                start = time.thread_time()
                out = func(*args, **kwargs)
                took = time.thread_time() - start
                # Copied after the call, not before: the copy would leave the cache full of
                # the call's data. An op that writes into its arguments leaves them with
                # other values but the same shapes and indices, which is what its time
                # depends on.
                calls.append((func, _copied(args), _copied(kwargs), took))
                return out

        self._mode = Mode()
        self._torch = torch

    def start(self) -> None:
        self._mode.__enter__()

    def stop(self) -> None:
        self._mode.__exit__(None, None, None)
        scratch = self._torch.empty(evict_bytes() // 4)

        def evict():
            scratch.fill_(1.0)

        rows = {}
        for func, args, kwargs, in_step in self.calls:
            row = rows.setdefault(func._schema.name, {"op": func._schema.name, "calls": 0,
                                                      "in_step": 0.0, "warm": 0.0,
                                                      "cold": 0.0})
            row["calls"] += 1
            row["in_step"] += in_step
            row["warm"] += time_alone(func, args, kwargs, self.repeats)
            row["cold"] += time_alone(func, args, kwargs, self.repeats, evict)
        self.calls.clear()
        self.counts = sorted(rows.values(), key=lambda r: -r["in_step"])


class _PythonTimes:
    """While active (start / stop), cProfile over the calling thread; `counts` then holds a
    row per Python function (and per C function it called, by name): where it is, its calls,
    its own time (the body, not its callees) and its time with its callees, totals over the
    recorded steps, the largest own time first."""

    def __init__(self):
        import cProfile

        self._profile = cProfile.Profile()
        self.counts: List[dict] = []

    def start(self) -> None:
        self._profile.enable()

    def stop(self) -> None:
        import pstats

        self._profile.disable()
        stats = pstats.Stats(self._profile).stats
        rows = [{"function": f"{_short_path(path)}:{line}({name})" if line else name,
                 "calls": calls, "own": own, "with_callees": total}
                for (path, line, name), (_, calls, own, total, _) in stats.items()]
        self.counts = sorted(rows, key=lambda r: -r["own"])


def _origin(function: str) -> str:
    """Where a _PythonTimes row's function is: "C" (a built-in: torch's ops and bindings, the
    interpreter's own), recxla's subpackage (recxla/data, recxla/pipeline, ...), else the top
    folder of its file (torchrec, torch, ...)."""
    if ":" not in function:
        return "C"
    parts = function.split(":", 1)[0].split(os.sep)
    if len(parts) < 2 or not parts[0]:
        return "other Python"
    return os.sep.join(parts[:2]) if parts[0] == "recxla" and len(parts) > 2 else parts[0]


def python_table(rows: List[dict], steps: int, n: int) -> str:
    """The first `n` _PythonTimes rows as a markdown table, milliseconds and calls a step,
    with each one's share of the thread's recorded own time."""
    total = sum(r["own"] for r in rows) or 1.0
    by_origin = Counter()
    for row in rows:
        by_origin[_origin(row["function"])] += row["own"]
    lines = [f"All functions' own time: {total * 1e3 / steps:.2f} ms a step, "
             f"{sum(r['calls'] for r in rows) / steps:,.0f} calls a step; by where they are: "
             + ", ".join(f"{origin} {seconds * 1e3 / steps:.2f}"
                         for origin, seconds in by_origin.most_common()) + ".", "",
             "| function | calls / step | own ms / step | own share | with callees ms / step |",
             "|---|---:|---:|---:|---:|"]
    for row in rows[:n]:
        lines.append(f"| `{row['function']}` | {row['calls'] / steps:g} | "
                     f"{row['own'] * 1e3 / steps:.3f} | {row['own'] / total:.1%} | "
                     f"{row['with_callees'] * 1e3 / steps:.3f} |")
    return "\n".join(lines)


def kernel_table(rows: List[dict], steps: int) -> str:
    """_KernelTimes rows as a markdown table, milliseconds a step, the total last."""
    lines = ["| op | calls / step | in the step (ms) | alone, warm (ms) | alone, cold (ms) | "
             "in the step / warm |", "|---|---|---|---|---|---|"]
    total = {"op": "all", "calls": 0, "in_step": 0.0, "warm": 0.0, "cold": 0.0}
    for row in rows + [total]:
        if row is not total:
            for key in ("calls", "in_step", "warm", "cold"):
                total[key] += row[key]
        ratio = row["in_step"] / row["warm"] if row["warm"] > 0 else float("nan")
        lines.append(f"| `{row['op']}` | {row['calls'] / steps:g} | "
                     f"{row['in_step'] * 1e3 / steps:.2f} | {row['warm'] * 1e3 / steps:.2f} | "
                     f"{row['cold'] * 1e3 / steps:.2f} | {ratio:.2f}x |")
    return "\n".join(lines)


def sync_sites(counts: Counter, steps: int) -> dict:
    """{(site, op): calls per step} of the step's own syncs (the synthetic batches' making,
    DATA_CODE, left out)."""
    return {key: calls / steps for key, calls in sorted(counts.items())
            if not key[0].startswith(DATA_CODE)}


def sync_table(counts: Counter, steps: int) -> str:
    """sync_sites as a markdown table."""
    lines = ["| site | op | calls / step |", "|---|---|---|"]
    for (where, op), per_step in sync_sites(counts, steps).items():
        lines.append(f"| `{where}` | `{op}` | {per_step:g} |")
    return "\n".join(lines)


def _short_path(path: str) -> str:
    """A source path relative to site-packages or to the current directory."""
    marker = os.sep + "site-packages" + os.sep
    if marker in path:
        return path.split(marker, 1)[1]
    return os.path.relpath(path) if path.startswith(os.getcwd()) else path


# What profile_run records on rank 0: op times (torch.profiler), ATen calls by line, host
# syncs by site, the recxla ops' times in the step and alone, or Python functions' own time.
RECORDERS = ("profiler", "calls", "syncs", "kernels", "python")


def profile_run(argv: List[str], warmup: int, rank: int = 0, world: int = 1,
                port: int = 0, recorder: str = "profiler"):
    """Run recxla-train ARGV as rank `rank` of `world` (port: the rendezvous's, 0 for a free
    one); returns (what `recorder` recorded over the measured steps on rank 0: the profiler's
    key averages, _CallsByLine's Counter, _HostSyncs' Counter, _KernelTimes' or _PythonTimes'
    rows; steps)."""
    if recorder not in RECORDERS:
        raise ValueError(f"bench.profile_train: recorder must be one of {RECORDERS}, got "
                         f"{recorder!r}")
    import torch
    from torch.profiler import ProfilerActivity, profile

    from recxla.train import cli, stages

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port or _free_port()))
    run_steps = stages.run_steps  # the name the trainer's loop stage calls
    captured = {}

    def profiled(pipeline, batches, first, last, meter, progress, on_step_done, log=None):
        prof = {"calls": _CallsByLine, "syncs": _HostSyncs, "kernels": _KernelTimes,
                "python": _PythonTimes}.get(
            recorder, lambda: profile(activities=[ProfilerActivity.CPU], record_shapes=False))()

        def step_done(done: int) -> None:
            on_step_done(done)
            if done == first + warmup and rank == 0:
                prof.start()

        try:
            return run_steps(pipeline, batches, first, last, meter, progress, step_done, log)
        finally:
            if rank == 0:
                prof.stop()
                captured["averages"] = prof.key_averages() if recorder == "profiler" else \
                    prof.counts
            captured["steps"] = last - first - warmup

    stages.run_steps = profiled
    try:
        assert cli.main(argv) == 0
    finally:
        stages.run_steps = run_steps
    torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
    return captured.get("averages"), captured["steps"]


def top_entries(averages, steps: int, n: int) -> List[dict]:
    """The n entries with the most self CPU time: name, share of all self CPU, ms and calls per
    step."""
    total = sum(e.self_cpu_time_total for e in averages) or 1
    rows = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [{"name": e.key, "share": e.self_cpu_time_total / total,
             "ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls_per_step": e.count / steps}
            for e in rows]


# The synthetic batches are made by recxla.data's code: in the rank's own thread on a CPU (the
# trainer's default there, --loader-workers 0), in a worker process on a GPU.
DATA_CODE = "recxla/data/"


def call_split(counts: Counter, steps: int):
    """(all ATen calls, the step's own, the synthetic batches' making) per step. The pipelines
    read ahead by different depths (TorchRec's two batches, DBP one), so a short window holds
    different numbers of batches made: compare the step's own calls."""
    total = sum(counts.values())
    data = sum(c for where, c in counts.items() if where.startswith(DATA_CODE))
    return total / steps, (total - data) / steps, data / steps


def top_lines(counts: Counter, steps: int, n: int) -> str:
    """The n lines with the most ATen calls, as a markdown table of calls per step, after the
    total and its split (call_split)."""
    total, own, data = call_split(counts, steps)
    lines = [f"all ATen calls: {total:.0f} a step: the step's own {own:.0f}, the synthetic "
             f"batches' making ({DATA_CODE}) {data:.0f}", "",
             "| line | calls / step | share |", "|---|---|---|"]
    for where, calls in counts.most_common(n):
        lines.append(f"| `{where}` | {calls / steps:.1f} | {calls / (total * steps):.1%} |")
    return "\n".join(lines)


def side_by_side(results: List[tuple]) -> str:
    """(schedule, counts, steps) of each path (counts: why, where it failed) -> a markdown
    table of their calls a step."""
    lines = ["| path | the step's own ATen calls | the synthetic batches' making |",
             "|---|---|---|"]
    for schedule, counts, steps in results:
        if isinstance(counts, str):  # the path failed: why
            lines.append(f"| {schedule} | failed: {counts} | |")
            continue
        _, own, data = call_split(counts, steps)
        lines.append(f"| {schedule} | {own:.0f} | {data:.0f} |")
    return "\n".join(lines)


# --python-times --side-by-side: the parts of a step's own time, by where the code lies.
PYTHON_PARTS = ("built-ins (ops, kernels, bindings)", "recxla's Python",
                "TorchRec's, FBGEMM's and torch's Python", "the synthetic batches (recxla/data)",
                "other Python")


def python_part(origin: str) -> str:
    """The PYTHON_PARTS entry of a _origin."""
    if origin == "C":
        return PYTHON_PARTS[0]
    if origin == "recxla/data":
        return PYTHON_PARTS[3]
    if origin.split(os.sep)[0] == "recxla":
        return PYTHON_PARTS[1]
    if origin in ("torchrec", "torch", "fbgemm_gpu"):
        return PYTHON_PARTS[2]
    return PYTHON_PARTS[4]


def python_side_by_side(results: List[tuple]) -> str:
    """(schedule, _PythonTimes rows, steps) of each path (rows: why, where it failed) -> a
    markdown table of their own time a step (ms) by PYTHON_PARTS, and their Python calls."""
    columns = []
    for schedule, rows, steps in results:
        if isinstance(rows, str):
            columns.append((schedule, None, rows))
            continue
        parts = Counter()
        for row in rows:
            parts[python_part(_origin(row["function"]))] += row["own"] * 1e3 / steps
        calls = sum(r["calls"] for r in rows) / steps
        columns.append((schedule, parts, calls))
    lines = ["| ms a step | " + " | ".join(s for s, _, _ in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for i, part in enumerate(PYTHON_PARTS + ("all",)):
        cells = [(f"failed: {extra}" if i == 0 else "") if parts is None else
                 f"{sum(parts.values()) if part == 'all' else parts[part]:.1f}"
                 for _, parts, extra in columns]
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    lines.append("| Python calls a step | " + " | ".join(
        "" if parts is None else f"{calls:,.0f}" for _, parts, calls in columns) + " |")
    return "\n".join(lines)


def markdown(entries: List[dict]) -> str:
    lines = ["| op or range | self CPU share | ms / step | calls / step |", "|---|---|---|---|"]
    for e in entries:
        lines.append(f"| `{e['name']}` | {e['share']:.1%} | {e['ms_per_step']:.2f} | "
                     f"{e['calls_per_step']:.0f} |")
    return "\n".join(lines)


def _profile_into(queue, *args) -> None:
    """profile_run(*args) in a process of its own, its result put on `queue`."""
    queue.put(profile_run(*args))


def run_ranks(train: List[str], warmup: int, ranks: int, recorder: str,
              fresh: bool = False):
    """recxla-train TRAIN on `ranks` processes over loopback, rank 0 profiled: -> profile_run's
    (averages, steps). Rank 0 runs in this process, or with `fresh` in a new one like the
    others: the other ranks are new processes each time, and TorchRec's DMP makes a collective
    once per process (its collective validation's broadcast), so a rank 0 that trained before
    would skip it while they wait in it."""
    port = _free_port()
    context = multiprocessing.get_context("spawn")
    others = [context.Process(target=profile_run, args=(train, warmup, r, ranks, port))
              for r in range(1, ranks)]
    queue = context.Queue() if fresh else None
    if fresh:
        others.append(context.Process(target=_profile_into, args=(
            queue, train, warmup, 0, ranks, port, recorder)))
    for process in others:
        process.start()
    try:
        result = _result_of(queue, others[-1]) if fresh else \
            profile_run(train, warmup, 0, ranks, port, recorder)
    finally:
        for process in others:
            process.join()
    return result


def _result_of(queue, rank0) -> tuple:
    """What rank 0's process puts on `queue`; RuntimeError when it exits without (its error
    is in the output above)."""
    import queue as queues

    while True:
        try:
            return queue.get(timeout=1.0)
        except queues.Empty:
            if not rank0.is_alive() and queue.empty():
                raise RuntimeError(f"rank 0 exited with code {rank0.exitcode} before its "
                                   "result (its error is above)") from None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", choices=tuple(SCHEDULES), default="sequential")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--ranks", type=int, default=1, help="processes over loopback (rank 0 "
                   "profiled)")
    p.add_argument("--calls-by-line", action="store_true",
                   help="count ATen calls by the line of Python that made them, not time ops")
    p.add_argument("--host-syncs", action="store_true",
                   help="count the calls that read values back to the host, by site")
    p.add_argument("--kernel-times", action="store_true",
                   help="time each recxla op call of the measured steps there and again alone, "
                   "warm and cold (--steps WARMUP + 2 is enough)")
    p.add_argument("--python-times", action="store_true",
                   help="cProfile rank 0's measured steps: the Python functions with the most "
                   "own time (--top of them)")
    p.add_argument("--side-by-side", action="store_true",
                   help=f"count the ATen calls a step of {', '.join(SIDE_BY_SIDE)} (the "
                   "trainer options after -- go to each), one table; with --python-times, "
                   "their own time by where it lies")
    args = p.parse_args(argv)

    common = ["--steps", str(args.steps), "--warmup-steps", str(args.warmup), "--eval-batches",
              "1", "--no-progress", *extra]

    def train_argv(schedule: str) -> List[str]:
        return [*common, "--label", schedule, *SCHEDULES[schedule]]

    load = os.getloadavg()
    if args.side_by_side:
        recorder = "python" if args.python_times else "calls"
        results = []
        for schedule in SIDE_BY_SIDE:
            try:
                counts, steps = run_ranks(train_argv(schedule), args.warmup, args.ranks,
                                          recorder, fresh=True)
            except RuntimeError as e:  # a path these options do not run (the table says so)
                counts, steps = str(e), 0
            results.append((schedule, counts, steps))
        print(f"\nrecxla-train {' '.join(common)} and each path's flags ("
              + "; ".join(f"{s}: {' '.join(SCHEDULES[s])}" for s in SIDE_BY_SIDE)
              + f") on {args.ranks} rank(s), rank 0, {args.steps - args.warmup} steps each; "
              f"load average "
              f"{load[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end")
        print(python_side_by_side(results) if args.python_times else side_by_side(results))
        return 0
    train = train_argv(args.schedule)
    recorder = "syncs" if args.host_syncs else "calls" if args.calls_by_line else \
        "kernels" if args.kernel_times else "python" if args.python_times else "profiler"
    averages, steps = run_ranks(train, args.warmup, args.ranks, recorder)
    print(f"\nrecxla-train {' '.join(train)} on {args.ranks} rank(s): {steps} steps profiled "
          f"on rank 0; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end")
    if args.host_syncs:
        print(sync_table(averages, steps))
    elif args.kernel_times:
        print(kernel_table(averages, steps))
    elif args.python_times:
        print(python_table(averages, steps, args.top))
    else:
        print(top_lines(averages, steps, args.top) if args.calls_by_line else
              markdown(top_entries(averages, steps, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
