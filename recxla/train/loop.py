"""The training loop: a pipeline's `progress()`, step by step, measured.

The TorchRec baseline runs TorchRec's TrainPipelineSparseDist (which overlaps the next batch's
id all-to-all with the current step) as `MeteredPipeline`, or TrainPipelineSparseDistLite
(`--baseline-pipeline`); the recxla path runs recxla.pipeline.TrainPipeline, which tags its own
phases. The metered TorchRec pipelines only tell the CommMeter which phase each collective
belongs to: "input" (the id all-to-alls of the input dist), "forward", "backward" (the embedding
gradients' all-to-all and the dense all-reduce) and "optimizer".

The dense all-reduce waits inside DDP's C++ finalize at the end of backward, where no Python
wait() can time it: a callback queued when backward starts runs once the autograd graph is done
and queues a second one behind DDP's finalize; the time between them is the caller blocked on
the all-reduce (plus DDP's copy of the averaged buckets into .grad, microseconds).

Per step (one `progress()` call) the loop records the wall time, the process's CPU time
(`process_cpu_seconds`: every thread's, gloo's and the compute pool's included), the time spent
producing the batch (`data_s`, part of the step), the loss, and the minor page faults; rank 0
shows a progress bar. Steps, checkpoints and the evaluation are reported to the watchdog as
progress.

A NaN or infinite loss stops the run at its first step (`NonFiniteLoss`, exit status
EXIT_NON_FINITE_LOSS): every later step would train on NaN weights, and the run would end with
`loss nan` and an AUC of chance. The check reads the value the loop reads anyway for the log and
the progress bar (one host read of the loss per step, on GPU the step's one sync), so it costs
no extra sync.
"""

import math
import resource
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional

import torch
from torch.autograd import Variable
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDistLite

from recxla.train.comm_meter import CommMeter
from recxla.train.faults import kill_point
from recxla.train.memory import minor_faults


# The exit status of a run stopped by a non-finite loss (recxla.train.cli lists them all).
EXIT_NON_FINITE_LOSS = 5
# Finite losses before the first non-finite one that its message shows (a loss that grows step
# by step points to divergence, a sudden NaN to the batch).
_LOSSES_SHOWN = 5


class NonFiniteLoss(FloatingPointError):
    """This rank's training loss at `step` (steps done, 1-based) is NaN or infinite."""

    exit_status = EXIT_NON_FINITE_LOSS

    def __init__(self, step: int, loss: float, before: List[float]):
        self.step, self.loss = step, loss
        shown = ", ".join(f"{x:.4g}" for x in before[-_LOSSES_SHOWN:]) or "none"
        super().__init__(
            f"the training loss is {loss} at step {step}, training stopped there (the losses "
            f"of this rank's steps before it: {shown}). Check the training data for NaN or "
            "infinite values (dense features, labels, per-id weights): a NaN in a batch gives "
            "a NaN loss at once; a loss that grows over the steps before points to divergence "
            "instead: lower --dense-lr and --sparse-lr")


def process_cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all its threads together (gloo's
    send/receive threads, the intra-op pool, the loader's thread); not child processes."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Metered:
    """Tags a TorchRec pipeline's collectives with phases for a CommMeter (`meter`)."""

    meter: CommMeter

    @property
    def torchrec_name(self) -> str:
        """The TorchRec pipeline's class name."""
        return next(c for c in type(self).__mro__ if c.__module__.startswith("torchrec.")).__name__

    def start_sparse_data_dist(self, *args, **kwargs):
        with self.meter.phase("input"):
            return super().start_sparse_data_dist(*args, **kwargs)

    def wait_sparse_data_dist(self, *args, **kwargs):
        with self.meter.phase("input"):
            return super().wait_sparse_data_dist(*args, **kwargs)

    def _backward(self, losses: torch.Tensor) -> None:
        clock, marks = self.meter.clock, {}
        engine = Variable._execution_engine

        def graph_done():
            marks["graph_done"] = clock()
            engine.queue_callback(lambda: marks.__setitem__("finalized", clock()))

        if losses.requires_grad:
            losses.register_hook(lambda grad: engine.queue_callback(graph_done))
        with self.meter.phase("backward"):
            super()._backward(losses)
            if len(marks) == 2:
                self.meter.add_blocked(marks["finalized"] - marks["graph_done"])

    def _optimizer_step(self) -> None:
        with self.meter.phase("optimizer"):
            super()._optimizer_step()


class MeteredPipeline(_Metered, TrainPipelineSparseDist):
    """TrainPipelineSparseDist: the next batch's input dist during this batch."""

    def __init__(self, model, optimizer, device: torch.device, meter: CommMeter):
        super().__init__(model, optimizer, device, execute_all_batches=True)
        self.meter = meter


class MeteredLitePipeline(_Metered, TrainPipelineSparseDistLite):
    """TrainPipelineSparseDistLite: one batch in flight, its input dist on the step's path."""

    def __init__(self, model, optimizer, device: torch.device, meter: CommMeter):
        super().__init__(model, optimizer, device)
        self.meter = meter


# --baseline-pipeline (recxla.train.config.BASELINE_PIPELINES): TorchRec's training pipelines
# that run on CPU with gloo and train what the plain loop trains. TrainPipelineFusedSparseDist
# and TrainPipelineSemiSync (which also trains on embeddings one update older) do not run on a
# CPU: their pipelined forward takes the CUDA device when there is no stream (TorchRec 1.9,
# train_pipeline/runtime_forwards.py); the prefetch and PT2 pipelines need CUDA too.
METERED_PIPELINES = {"sparse_dist": MeteredPipeline, "sparse_dist_lite": MeteredLitePipeline}


class TimedIterator:
    """Wraps a batch iterator; `take()` returns the seconds spent in next() since last take."""

    def __init__(self, batches: Iterator, clock: Callable[[], float]):
        self._batches, self._clock, self._spent = batches, clock, 0.0

    def __iter__(self):
        return self

    def __next__(self):
        start = self._clock()
        try:
            return next(self._batches)
        finally:
            self._spent += self._clock() - start

    def take(self) -> float:
        spent, self._spent = self._spent, 0.0
        return spent


@dataclass
class StepLog:
    """What this rank measured, one entry per step run (index: step - first)."""

    first: int = 0
    seconds: List[float] = field(default_factory=list)
    cpu_s: List[float] = field(default_factory=list)
    data_s: List[float] = field(default_factory=list)
    loss: List[float] = field(default_factory=list)
    faults: List[int] = field(default_factory=list)
    checkpoint_s: float = 0.0


class Progress:
    """rank 0's tqdm bar with examples/s and loss; a no-op elsewhere."""

    def __init__(self, enabled: bool, total: int, initial: int, examples_per_step: int):
        self.bar = None
        self.examples_per_step = examples_per_step
        if enabled:
            import sys

            from tqdm import tqdm

            # Not a terminal (a log file, make's output): a line every few seconds, not a
            # carriage-return redraw every step.
            interval = 0.1 if sys.stderr.isatty() else 5.0
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                            desc="train", mininterval=interval, file=sys.stderr)

    def update(self, seconds: float, loss: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"{self.examples_per_step / seconds:,.0f} ex/s, loss {loss:.4f}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_steps(pipeline, batches: Iterator, first: int, last: int,
              meter: CommMeter, progress: Progress, on_step_done: Callable[[int], None],
              log: Optional[StepLog] = None) -> StepLog:
    """Train steps first .. last - 1 with `pipeline` (a METERED_PIPELINES one or recxla's
    TrainPipeline: anything with `progress(iterator)`; `batches` yields exactly their batches).

    on_step_done(steps_done) runs after each step (watchdog, checkpoints); its time is not
    part of the step. Returns the StepLog. Raises NonFiniteLoss at the first step whose loss is
    NaN or infinite, before that step's on_step_done (no checkpoint of its weights).
    """
    log = log or StepLog(first=first)
    timed = TimedIterator(batches, meter.clock)
    for step in range(first, last):
        faults = minor_faults()
        meter.begin_step(step)
        start, cpu_start = meter.clock(), process_cpu_seconds()
        with meter.phase("forward"):
            loss, _, _ = pipeline.progress(timed)
        seconds = meter.clock() - start
        log.cpu_s.append(process_cpu_seconds() - cpu_start)
        meter.end_step()
        log.seconds.append(seconds)
        log.data_s.append(timed.take())
        log.faults.append(minor_faults() - faults)
        log.loss.append(float(loss))  # the step's one host read of the loss
        if not math.isfinite(log.loss[-1]):
            raise NonFiniteLoss(step + 1, log.loss[-1], log.loss[:-1])
        progress.update(seconds, log.loss[-1])
        on_step_done(step + 1)
        kill_point(f"step {step + 1}")  # fault injection for tests (recxla.train.faults)
    return log
