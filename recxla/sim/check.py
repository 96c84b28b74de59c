"""Feeding measured runs into the model: what the emulated cluster gives, next to what the
model says for the same configuration.

A measured run is one JSON object (a list of them per file), the trainer's metrics plus the
configuration it ran under:

    {"nodes": 2, "ranks_per_node": 2, "link_gbit": 0.2, "batch_size": 1024,
     "embedding_dim": 64, "topology": "1d", "fwd_comm": "e4m3", "bwd_comm": "bf16",
     "overlap": true, "micro_batches": 4, "imbalance": 1.0,
     "examples_per_s": 8800.0, "exposed_comm_fraction": 0.3}

`batch_size` is per rank; `imbalance`, `micro_batches`, `exposed_comm_fraction`,
`wire_bytes_per_step` (per rank, the trainer's counted bytes) and `max_rows` (the tables' row
cap, default 100,000 as in the trainer's runs) are optional. Where the run gives its bytes, the
row shows them next to the model's: a miss in bytes (the plan: data-parallel tables, say) is
then told apart from a miss in rates. The
hardware is `emulated(link_gbit, ranks_per_node)` (measured figures of this machine) and the
workload is recxla.data's Criteo profile at that dimension and batch. `compare_runs` returns
one row per run: measured and modeled examples/s and their ratio.
"""

import json
from typing import Dict, List

from recxla.sim.hardware import emulated
from recxla.sim.model import StepConfig, step
from recxla.sim.workload import Workload

REQUIRED = ("nodes", "ranks_per_node", "link_gbit", "batch_size", "embedding_dim",
            "topology", "fwd_comm", "bwd_comm", "overlap", "examples_per_s")


def load_runs(paths) -> List[dict]:
    """Runs from JSON files (an object or a list of objects each)."""
    runs = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        runs.extend(data if isinstance(data, list) else [data])
    return runs


def compare_runs(runs: List[dict]) -> List[Dict[str, object]]:
    """Model each measured run (see the module docstring for the fields)."""
    from recxla.data import criteo_kaggle_profile

    rows, workloads = [], {}
    for i, run in enumerate(runs):
        missing = [k for k in REQUIRED if k not in run]
        if missing:
            raise ValueError(f"recxla.sim.compare_runs: run {i} lacks {missing}")
        key = (run["embedding_dim"], run["batch_size"], run.get("max_rows", 100_000))
        if key not in workloads:
            profile = criteo_kaggle_profile(max_rows=key[2])
            workloads[key] = Workload.measure(profile, dim=key[0], batch_size=key[1])
        config = StepConfig(
            topology=run["topology"], fwd_comm=run["fwd_comm"], bwd_comm=run["bwd_comm"],
            overlap=bool(run["overlap"]), micro_batches=int(run.get("micro_batches", 1)),
            imbalance=float(run.get("imbalance", 1.0)),
        )
        hw = emulated(float(run["link_gbit"]), int(run["ranks_per_node"]))
        modeled = step(workloads[key], hw, int(run["nodes"]), int(run["batch_size"]), config)
        rows.append({
            "run": i,
            "nodes x ranks": f"{run['nodes']}x{run['ranks_per_node']}",
            "link_gbit": run["link_gbit"],
            "config": f"{config.topology} {config.fwd_comm}/{config.bwd_comm} "
                      f"overlap={'on' if config.overlap else 'off'}",
            "measured examples/s": float(run["examples_per_s"]),
            "modeled examples/s": modeled.examples_per_s,
            "modeled / measured": modeled.examples_per_s / float(run["examples_per_s"]),
            "modeled exposed comm fraction": modeled.exposed_communication / modeled.step,
            "measured exposed comm fraction": run.get("exposed_comm_fraction"),
            "modeled wire bytes/step": modeled.wire_bytes,
            "measured wire bytes/step": run.get("wire_bytes_per_step"),
        })
    return rows
