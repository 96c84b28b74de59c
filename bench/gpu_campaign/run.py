"""The campaign's driver: stages with time budgets inside one deadline, their outcomes, the
summary table, and the few files that come back from the GPU machine.

A stage is a function of a `Campaign` that returns a `StageResult`. Stages that only check
correctness may run at once (the GPU has room for several test processes); stages that time run
alone. Every command a stage starts goes through `Campaign.command`: its output goes to a log of
its own, it is killed at its budget (and at the campaign's deadline), and its exit status and
time are kept. A stage that raises is recorded as failed and the next one runs.

What comes back ($OUT): the machine returns at most 8 files, so the campaign leaves exactly
these: gpu.md and gpu.json (the report), summary.txt (the table printed last), campaign.log
(this driver's own log), logs.tar.gz (every stage's logs and raw outputs) and, when the trainer
stage traced, kernel_trace.json.gz.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Seconds kept back from the deadline for the report and the packing of the outputs.
REPORT_RESERVE_S = 25


@dataclass
class StageResult:
    """What a stage found. status: "pass", "fail", "skip" (not applicable: said why) or
    "timeout". summary: one line for the table. data: the stage's figures (JSON-able)."""

    status: str
    summary: str
    data: dict = field(default_factory=dict)
    seconds: float = 0.0
    name: str = ""


@dataclass
class Command:
    """One command a stage ran."""

    argv: List[str]
    log: str
    returncode: Optional[int]
    timed_out: bool
    seconds: float


class Campaign:
    """The shared state of one campaign run.

    Args:
        out: the folder that comes back ($OUT); work files go to out/work and are packed.
        dry_run: run on CPU what needs no GPU (see stages.py for what each stage does then).
        deadline_s: the whole campaign's wall-clock limit, counted from construction.
    """

    def __init__(self, out: str, dry_run: bool, deadline_s: float):
        self.out = os.path.abspath(out)
        self.work = os.path.join(self.out, "work")
        os.makedirs(self.work, exist_ok=True)
        self.dry_run = dry_run
        self.started = time.monotonic()
        self.deadline = self.started + deadline_s
        self.env = dict(os.environ)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (ROOT, self.env.get("PYTHONPATH", "")) if p)
        self.python = sys.executable
        self.results: Dict[str, StageResult] = {}
        # Parts of stages to rerun (tests_k: pytest -k; kernel_modules), set by the command line.
        self.options: dict = {"tests_k": None, "kernel_modules": None}
        self._log_lock = threading.Lock()
        self._log = open(os.path.join(self.out, "campaign.log"), "a", buffering=1)

    # ------------------------------------------------------------------ time and logs

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def budget(self, wanted_s: float) -> float:
        """A stage's budget: what it asks for, cut to what the deadline leaves (after the
        report's reserve); at least 1 s, so that a late stage still records a timeout."""
        return max(1.0, min(wanted_s, self.remaining() - REPORT_RESERVE_S))

    def log(self, message: str) -> None:
        line = f"[{time.monotonic() - self.started:7.1f}s] {message}"
        with self._log_lock:
            print(line, flush=True)
            self._log.write(line + "\n")

    def path(self, name: str) -> str:
        return os.path.join(self.work, name)

    # ------------------------------------------------------------------ commands

    def command(self, argv: Sequence[str], log_name: str, budget_s: float,
                env: Optional[dict] = None, cwd: str = ROOT) -> Command:
        """Runs argv with its output in work/<log_name>, killed (with its process group) after
        budget_s seconds, or at the deadline if that comes first."""
        timeout = max(1.0, min(budget_s, self.remaining() - REPORT_RESERVE_S))
        log_path = self.path(log_name)
        began = time.monotonic()
        self.log(f"$ {' '.join(argv)}  (budget {timeout:.0f} s, log {log_name})")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                    env=env or self.env, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc, timed_out = None, True
        seconds = time.monotonic() - began
        self.log(f"  -> {'timed out' if timed_out else f'exit {rc}'} after {seconds:.1f} s")
        return Command(list(argv), log_name, rc, timed_out, seconds)

    def tail(self, log_name: str, lines: int = 15) -> str:
        try:
            with open(self.path(log_name), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def write_json(self, name: str, data) -> str:
        path = self.path(name)
        with open(path, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        return path

    def read_json(self, name: str):
        with open(self.path(name)) as f:
            return json.load(f)

    # ------------------------------------------------------------------ stages

    def run_stage(self, name: str, fn: Callable[["Campaign"], StageResult]) -> StageResult:
        began = time.monotonic()
        self.log(f"=== {name}")
        if self.remaining() <= REPORT_RESERVE_S:
            result = StageResult("timeout", "not started: the campaign's deadline was reached")
        else:
            try:
                result = fn(self)
            except Exception as e:  # noqa: BLE001 - a broken stage must not end the campaign
                import traceback

                with open(self.path(f"{name}.error.txt"), "w") as f:
                    traceback.print_exc(file=f)
                result = StageResult("fail", f"the stage raised {type(e).__name__}: {e}")
        result.summary = " ".join(result.summary.split())[:400]  # one line of the table
        result.seconds = round(time.monotonic() - began, 1)
        result.name = name
        self.results[name] = result
        self.log(f"=== {name}: {result.status} ({result.seconds} s): {result.summary}")
        return result

    def run_parallel(self, stages: Sequence[tuple]) -> None:
        """Runs (name, fn) stages at once (correctness stages only: they share the GPU)."""
        with ThreadPoolExecutor(max_workers=len(stages)) as pool:
            for future in [pool.submit(self.run_stage, name, fn) for name, fn in stages]:
                future.result()

    # ------------------------------------------------------------------ the end

    def summary_table(self) -> str:
        rows = [("stage", "status", "s", "summary")]
        for r in self.results.values():
            rows.append((r.name, r.status, f"{r.seconds:.0f}", r.summary))
        width = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"{a:<{width[0]}}  {b:<{width[1]}}  {c:>{width[2]}}  {d}" for a, b, c, d in rows]
        total = time.monotonic() - self.started
        mode = "dry run (CPU)" if self.dry_run else "GPU"
        return "\n".join(lines + [f"campaign ({mode}): {total:.0f} s"])

    def finish(self) -> None:
        """Packs work/ into logs.tar.gz and removes it, so that out/ holds the few files that
        come back."""
        with tarfile.open(os.path.join(self.out, "logs.tar.gz"), "w:gz") as tar:
            tar.add(self.work, arcname="campaign")
        shutil.rmtree(self.work, ignore_errors=True)
        self._log.close()


def results_json(campaign: Campaign) -> dict:
    return {name: asdict(r) for name, r in campaign.results.items()}
