"""recxla.sim: a cost model of one training step on N nodes x G ranks, to see how a job will
scale before renting the cluster.

- `Hardware` and its presets (`H100_IB`, `H100_P5`, `A100_P4D`, `emulated(...)`): links,
  latencies and throughputs, each with its source.
- `Workload`: per-example pooled columns, ids (after dedup) and dense FLOPs, measured on
  recxla.data batches (`Workload.measure`).
- `StepConfig`, `step`, `scaling`: the step's terms for 1D/2D, each comm format, overlap on/off.
- `recxla.sim.published`: the model against Pinterest's and NestPipe's published results.
- `recxla.sim.check`: the model against measured runs of the emulated cluster.
`python -m recxla.sim` prints a table and writes a PNG of examples/s and efficiency.
"""

from recxla.sim.hardware import A100_P4D, H100_IB, H100_P5, Hardware, emulated, preset
from recxla.sim.model import (
    ScalingPoint,
    StepBreakdown,
    StepConfig,
    all_reduce_seconds,
    all_to_all_seconds,
    scaling,
    step,
)
from recxla.sim.workload import Workload, dlrm_dense_flops

__all__ = [
    "A100_P4D",
    "H100_IB",
    "H100_P5",
    "Hardware",
    "ScalingPoint",
    "StepBreakdown",
    "StepConfig",
    "Workload",
    "all_reduce_seconds",
    "all_to_all_seconds",
    "dlrm_dense_flops",
    "emulated",
    "preset",
    "scaling",
    "step",
]
