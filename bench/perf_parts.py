"""Where the trainer's CPU goes, by part: perf samples of a running multi-rank job, each put in
one part (the dense layers' GEMM, ATen's kernels, Python and dispatch, FBGEMM, recxla's kernels,
gloo's threads, libc) by its thread, library and symbol.

    python -m bench.perf_parts --ranks 4 \\
        --run "TorchRec bf16+AR=--baseline torchrec --baseline-comms bf16 --dense-allreduce bf16" \\
        --run "recxla DBP=--dense-allreduce bf16" \\
        --run "dense floor=--baseline torchrec --dense-floor --dense-allreduce bf16"

Each run is `torchrun --standalone --nproc-per-node RANKS -m recxla.train --threads 1 --steps
STEPS` with the run's options, over loopback; after --settle seconds (the ranks' setup) `perf
record -a -g` samples the whole machine for --seconds while they train, so nothing else should
run, and the run must outlast the sample (else an error says to give it more steps). The parts'
shares of the busy samples are scaled to the trainer's own CPU per example (all ranks, all
threads), and the table (markdown) gives each run's parts in microseconds of CPU an example and
its total above the run labelled `dense floor`, if any. Needs `perf` (Linux perf events, as
root or with kernel.perf_event_paranoid <= -1); bench/results/training.md has a table made with
it.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Dict, List, Optional, Tuple

# The parts, in the table's order.
PARTS = [
    "MKL GEMM (the dense layers)",
    "ATen kernels (copies, elementwise, index, cat, the dense optimizer)",
    "Python and torch's dispatch (interpreter, bindings, dispatcher, autograd engine)",
    "FBGEMM's kernels",
    "recxla's C++ kernels",
    "gloo's threads (TCP)",
    "libc (malloc, memcpy) and the rest",
]
GEMM, ATEN, DISPATCH, FBGEMM, RECXLA, GLOO, REST = PARTS
IDLE = "idle"
FLOOR = "dense floor"
# ATen's kernels by their symbols: the loops of TensorIterator and the named native kernels.
_ATEN_KERNEL = re.compile(r"at::native::|Sleef|VectorizedLoop2d|loop_2d_from_1d")
_SAMPLE = re.compile(r"\s+([\d.]+)%\s+(\S+)\s+(\S+)\s+\[.\]\s+(.*)")


def part_of(thread: str, library: str, symbol: str) -> str:
    """The part of one sample: its thread's name (perf's comm), library (dso) and symbol."""
    if thread == "swapper":
        return IDLE
    if "gloo" in thread:
        return GLOO
    if thread != "python":  # e.g. torchrun's agent (pt_elastic): not the ranks' work
        return REST
    if "mkl" in symbol:
        return GEMM
    if "fbgemm" in library:
        return FBGEMM
    if library.startswith("_C."):
        return RECXLA
    if "libpython" in library or "libtorch_python" in library or library.startswith("libc10."):
        return DISPATCH
    if library.startswith("libtorch_cpu"):
        return ATEN if _ATEN_KERNEL.search(symbol) else DISPATCH
    return REST


def parts_of_report(report: str) -> Dict[str, float]:
    """Percent of all samples per part (idle included) from `perf report --sort comm,dso,sym
    --stdio -g none`."""
    shares: Counter = Counter()
    for line in report.splitlines():
        m = _SAMPLE.match(line)
        if m:
            shares[part_of(m.group(2), m.group(3), m.group(4))] += float(m.group(1))
    return dict(shares)


def per_example(shares: Dict[str, float], cpu_us_per_example: float) -> Dict[str, float]:
    """The busy parts scaled so that they sum to the trainer's CPU per example."""
    busy = {k: v for k, v in shares.items() if k != IDLE}
    total = sum(busy.values())
    if total <= 0:
        raise ValueError("perf_parts: no busy samples (did the trainer run during the sample?)")
    return {k: cpu_us_per_example * v / total for k, v in busy.items()}


def _cpu_per_example(log: str) -> float:
    m = re.search(r"CPU/example\s+([\d.]+) us", log)
    if not m:
        raise RuntimeError(f"perf_parts: the trainer printed no CPU per example:\n{log[-2000:]}")
    return float(m.group(1))


def profile_run(options: List[str], ranks: int, steps: int, settle: float, seconds: float,
                work: str, label: str) -> Tuple[Dict[str, float], float]:
    """(percent of samples per part, the trainer's CPU us per example) of one run."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", "-m", "recxla.train",
            "--threads", "1", "--no-progress", "--eval-batches", "1", "--warmup-steps", "5",
            "--steps", str(steps), *options]
    data = os.path.join(work, re.sub(r"\W+", "_", label) + ".data")
    with tempfile.TemporaryFile("w+") as log:
        trainer = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            time.sleep(settle)
            subprocess.run(["perf", "record", "-a", "-g", "-F", "499", "-o", data, "--",
                            "sleep", str(seconds)], check=True, capture_output=True)
            # A sample that saw the ranks set up or shut down would count that work as theirs.
            ended_early = trainer.poll() is not None
            rc = trainer.wait()
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
        log.seek(0)
        text = log.read()
    if rc != 0:
        raise RuntimeError(f"perf_parts: {label}: the trainer failed:\n{text[-2000:]}")
    if ended_early:
        raise RuntimeError(f"perf_parts: {label}: the trainer ended within the sample; "
                           f"give it more --steps than {steps}")
    report = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort",
                             "comm,dso,sym", "--stdio", "-g", "none"], check=True,
                            capture_output=True, text=True).stdout
    return parts_of_report(report), _cpu_per_example(text)


def markdown(results: Dict[str, Dict[str, float]]) -> str:
    labels = list(results)
    lines = ["| part | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for part in PARTS:
        lines.append(f"| {part} | " + " | ".join(f"{results[x].get(part, 0.0):.1f}"
                                                 for x in labels) + " |")
    totals = {x: sum(results[x].values()) for x in labels}
    lines.append("| all: the trainer's CPU per example | " +
                 " | ".join(f"{totals[x]:.1f}" for x in labels) + " |")
    if FLOOR in results:
        lines.append("| above the dense floor | " +
                     " | ".join(f"{totals[x] - totals[FLOOR]:.1f}" for x in labels) + " |")
    return "\n".join(lines)


def parse_run(text: str) -> Tuple[str, List[str]]:
    label, sep, options = text.partition("=")
    if not sep or not label.strip():
        raise argparse.ArgumentTypeError(f"--run takes LABEL=trainer options, got {text!r}")
    return label.strip(), options.split()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf_parts",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=parse_run, action="append", required=True,
                   help="LABEL=trainer options (repeat for each run)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=400,
                   help="steps a run (enough to outlast --settle + --seconds)")
    p.add_argument("--settle", type=float, default=35.0,
                   help="seconds from the launch to the sample (the ranks' setup)")
    p.add_argument("--seconds", type=float, default=15.0, help="length of the sample")
    args = p.parse_args(argv)
    if shutil.which("perf") is None:
        p.error("needs `perf` on PATH (Linux perf events; e.g. the linux-tools package)")
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for label, options in args.run:
            shares, cpu = profile_run(options, args.ranks, args.steps, args.settle,
                                       args.seconds, work, label)
            results[label] = per_example(shares, cpu)
            print(f"{label}: {cpu:.1f} us of CPU an example", flush=True)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
