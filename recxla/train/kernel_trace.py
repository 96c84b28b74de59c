"""`--kernel-trace PATH`: a torch.profiler trace of a few measured steps, with the device's side.

recxla's own `--trace` records the host: when each part of the step ran and waited. This one
records what the device ran: every CUDA kernel and copy with the stream it ran on (and the CPU
ops that launched them), as a Chrome trace (chrome://tracing, Perfetto). It shows whether the
copy and communication streams' work runs under the compute stream's kernels
(bench/gpu_campaign/trace_overlap.py measures that share). It traces KERNEL_TRACE_STEPS steps
right after the warm-up; rank r > 0 writes PATH with `.rank<r>` before its extension, and a
PATH ending in .gz is compressed.
"""

import gzip
import os
import shutil
from typing import Optional

import torch

# Steps traced: enough for a steady state, few enough that the trace stays small (tens of MB).
KERNEL_TRACE_STEPS = 4


def rank_path(path: str, rank: int) -> str:
    """PATH for rank 0, PATH with `.rank<r>` before the extension (.json or .json.gz) else."""
    if rank == 0:
        return path
    for ext in (".json.gz", ".json", ".gz"):
        if path.endswith(ext):
            return f"{path[:-len(ext)]}.rank{rank}{ext}"
    return f"{path}.rank{rank}"


class KernelTrace:
    """Profiles the steps (first + warmup, first + warmup + KERNEL_TRACE_STEPS]: call
    `step_done(done)` after each step (done = steps finished so far), `close()` at the end."""

    def __init__(self, path: Optional[str], rank: int, first: int, warmup: int, last: int):
        self.path = None if path is None else rank_path(path, rank)
        self.begin = first + warmup
        self.end = min(self.begin + KERNEL_TRACE_STEPS, last)
        self._profiler = None
        self.written: Optional[str] = None
        if self.path is not None and self.begin == first:
            self._start()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()

    def step_done(self, done: int) -> None:
        if self.path is None:
            return
        if done == self.begin and self._profiler is None:
            self._start()
        elif done == self.end:
            self.close()

    def close(self) -> None:
        """Stops the profiler (if it runs) and writes the trace."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        profiler.__exit__(None, None, None)
        plain = self.path[:-3] if self.path.endswith(".gz") else self.path
        profiler.export_chrome_trace(plain)
        if plain != self.path:
            with open(plain, "rb") as src, gzip.open(self.path, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(plain)
        self.written = self.path
