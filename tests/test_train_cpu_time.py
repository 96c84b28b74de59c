"""The trainer's CPU time per step: the process's, every thread's included, and only the step's.

A thread burns a known amount of its own CPU (its thread clock), so the expectations hold on a
loaded machine: load stretches wall time, not CPU time.
"""

import threading
import time

import pytest

from recxla.train.comm_meter import CommMeter
from recxla.train.loop import Progress, process_cpu_seconds, run_steps

BURN_S = 0.15


def _burn_in_thread(seconds: float) -> None:
    """Spin another thread until it has used `seconds` of its own CPU; wait for it."""
    def spin():
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    worker = threading.Thread(target=spin)
    worker.start()
    worker.join()


def test_process_cpu_seconds_counts_other_threads_and_not_sleep():
    start = process_cpu_seconds()
    _burn_in_thread(BURN_S)  # this thread only waits: the CPU is the other thread's
    burned = process_cpu_seconds() - start
    assert BURN_S <= burned < BURN_S + 0.1
    start = process_cpu_seconds()
    time.sleep(BURN_S)
    assert process_cpu_seconds() - start < 0.05


class _BurningPipeline:
    """A pipeline whose step burns `burn[i]` CPU seconds in another thread and sleeps."""

    def __init__(self, burn):
        self.burn = list(burn)

    def progress(self, batches):
        next(batches)
        _burn_in_thread(self.burn.pop(0))
        time.sleep(0.05)  # wall time that is no CPU time
        return 0.5, None, None


def test_run_steps_records_each_steps_cpu_time_only():
    burn = [0.02, 0.12, 0.06]
    between = []  # CPU burned between steps (on_step_done) is not the step's

    def on_step_done(done):
        between.append(done)
        _burn_in_thread(0.1)

    log = run_steps(_BurningPipeline(burn), iter(range(len(burn))), 0, len(burn),
                    CommMeter(ranks_per_node=1), Progress(False, 3, 0, 1), on_step_done)
    assert between == [1, 2, 3]
    assert len(log.cpu_s) == len(burn)
    for cpu, burned in zip(log.cpu_s, burn):
        # the step's burn, not its sleep (0.05 s of wall time) nor the 0.1 s between steps
        assert burned <= cpu < burned + 0.04


def test_summary_cpu_figures_over_ranks():
    from recxla.train.parse import parse_config
    from recxla.train.metrics import summarize

    config = parse_config(["--batch-size", "100"])
    ranks = []
    for cpu in ([0.1, 0.2, 0.3], [0.4, 0.4, 0.7]):
        ranks.append({"seconds": [1.0] * 3, "cpu_s": cpu, "data_s": [0.0] * 3,
                      "faults": [0] * 3, "loss": [0.5], "exposed_s": [0.0] * 3,
                      "comm_s": [0.0] * 3, "exposed_fwd_s": [0.0] * 3, "bytes": [{}] * 3,
                      "cross_node": [0] * 3, "checkpoint_s": 0.0})
    s = summarize(config, ranks, 2)
    assert s["cpu_s_per_step"] == pytest.approx(
        {"p50": 0.3, "p50_max_rank": 0.4, "mean": 0.35, "mean_max_rank": 0.5})
    # per example: the ranks' mean CPU per step over samples per rank
    assert s["cpu_us_per_example"] == pytest.approx({"mean": 3500.0, "max_rank": 5000.0})
    assert s["cpu_cores_per_rank"] == pytest.approx(0.35)
