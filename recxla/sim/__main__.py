"""python -m recxla.sim: predicted examples/s and scaling efficiency against node count.

    python -m recxla.sim [--hardware h100-ib] [--nodes 1,2,4,8,16,32,64] [--batch 4096]
                         [--dim 64] [--plot scaling.png] [--published] [--check runs.json ...]

Prints, for each configuration (TorchRec-like baseline: 1D, fp32, no overlap; then recxla's
steps: FP8 comms, the FWP/DBP overlap, the 2D topology), a table of examples/s, speedup and
efficiency over one node, step time and exposed communication, and writes a PNG with examples/s
and scaling efficiency against node count. --published adds the comparison with Pinterest's
and NestPipe's results; --check models measured runs (recxla.sim.check).
"""

import argparse
import sys
from dataclasses import replace
from typing import List, Sequence, Tuple

from recxla.sim.hardware import preset
from recxla.sim.model import StepConfig, scaling
from recxla.sim.workload import Workload

CONFIGS: Tuple[Tuple[str, StepConfig], ...] = (
    ("1d fp32, no overlap", StepConfig("1d", "fp32", "fp32", overlap=False, micro_batches=1)),
    ("1d e4m3/bf16, no overlap", StepConfig("1d", "e4m3", "bf16", overlap=False,
                                            micro_batches=1)),
    ("1d e4m3/bf16, overlap", StepConfig("1d", "e4m3", "bf16", overlap=True, micro_batches=4)),
    ("2d e4m3/bf16, overlap", StepConfig("2d", "e4m3", "bf16", overlap=True, micro_batches=4)),
)


def table(rows: List[dict], columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for c in columns:
            v = row[c]
            cells.append(f"{v:,.3g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def predict(workload, hw, nodes, batch, imbalance) -> List[Tuple[str, list]]:
    out = []
    for name, config in CONFIGS:
        config = StepConfig(**{**config.__dict__, "imbalance": imbalance})
        out.append((name, scaling(workload, hw, nodes, batch, config)))
    return out


def plot(results, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, points in results:
        nodes = [p.nodes for p in points]
        left.plot(nodes, [p.breakdown.examples_per_s for p in points], marker="o", label=name)
        right.plot(nodes, [100 * p.efficiency for p in points], marker="o", label=name)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes")
        ax.grid(True, alpha=0.3)
    left.set_yscale("log")
    left.set_ylabel("examples/s")
    right.set_ylabel("scaling efficiency, % of linear from 1 node")
    right.set_ylim(0, 105)
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_diagnostics() -> None:
    """One-point calibrations (not predictions): how much more dense work per example than
    the Criteo DLRM the published workloads must have, and what follows from it."""
    from recxla.sim.hardware import H100_IB
    from recxla.sim.published import dense_scale_for, pinterest_one_point

    k, rows = pinterest_one_point()
    print(f"\n# diagnostic: dense work per example x{k:,.0f} (set so the model gives Pinterest's "
          "1.13x at 2 nodes before); the rest then follows")
    print(table([{"what": c.what, "published": c.published, "predicted": c.predicted,
                  "miss": f"{100 * c.miss:+.0f}%"} for c in rows],
                ["what", "published", "predicted", "miss"]))
    work = Workload.measure(dim=64, batch_size=4096)
    nodes = 1536 // H100_IB.gpus_per_node
    config = StepConfig("1d", "e4m3", "bf16", overlap=True, micro_batches=4)
    k_nest = dense_scale_for(0.9407 * nodes, work, H100_IB, nodes, 4096, config)
    k_off = dense_scale_for(0.9407 * nodes, work, H100_IB, nodes, 4096,
                            StepConfig("1d", "e4m3", "bf16", overlap=False, micro_batches=1))
    print(f"\n# diagnostic: NestPipe's 94.07% at 1,536 workers needs x{k_nest:,.0f} the DLRM's "
          f"dense work per example with FWP/DBP overlap, x{k_off:,.0f} without")


def _bad_input(e: Exception) -> int:
    """One line naming the problem (the library's own prefix once), and status 2."""
    print(f"python -m recxla.sim: {str(e).removeprefix('recxla.sim: ')}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recxla.sim", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--hardware", default="h100-ib",
                        help="h100-ib, h100-p5, a100-p4d or emulated-<gbit>gbit-<ranks>rpn")
    parser.add_argument("--nodes", default="1,2,4,8,16,32,64")
    parser.add_argument("--batch", type=int, default=4096, help="examples per rank per step")
    parser.add_argument("--dim", type=int, default=64, help="embedding dimension")
    parser.add_argument("--max-rows", type=int, default=None, help="cap on table rows")
    parser.add_argument("--fixed-step-ms", type=float, default=0.0,
                        help="a step's cost whatever its size (measure it on one node)")
    parser.add_argument("--imbalance", type=float, default=1.0,
                        help="max/mean of per-rank all-to-all bytes (recxla.planner)")
    parser.add_argument("--plot", default="scaling.png", help="PNG path ('' for none)")
    parser.add_argument("--published", action="store_true",
                        help="compare with Pinterest's and NestPipe's published results")
    parser.add_argument("--check", nargs="*", default=None, metavar="RUNS.json",
                        help="model measured runs (format: recxla.sim.check)")
    args = parser.parse_args(argv)
    try:
        hw = replace(preset(args.hardware), fixed_step_s=args.fixed_step_ms / 1e3)
        nodes = [int(n) for n in args.nodes.split(",")]
        if not nodes or min(nodes) < 1:
            raise ValueError("--nodes must list node counts >= 1")
        from recxla.data import criteo_kaggle_profile

        workload = Workload.measure(criteo_kaggle_profile(max_rows=args.max_rows), dim=args.dim,
                                    batch_size=args.batch)
        results = predict(workload, hw, nodes, args.batch, args.imbalance)
    except ValueError as e:
        return _bad_input(e)
    print(f"# {workload.name} on {hw.name} ({hw.source}); {args.batch} examples per rank, "
          f"{hw.gpus_per_node} ranks per node")
    rows = []
    for name, points in results:
        for p in points:
            b = p.breakdown
            rows.append({
                "config": name, "nodes": p.nodes, "examples/s": b.examples_per_s,
                "speedup": p.speedup, "efficiency": p.efficiency, "step ms": 1e3 * b.step,
                "a2a ms": 1e3 * (b.ids_a2a + b.output_a2a + b.grad_a2a),
                "exposed comm ms": 1e3 * b.exposed_communication, "dense ms": 1e3 * b.dense,
            })
    print(table(rows, list(rows[0])))
    if args.plot:
        plot(results, args.plot, f"{workload.name}, {args.batch}/rank, {hw.name}")
        print(f"\nwrote {args.plot}")
    if args.published:
        from recxla.sim.published import ASSUMPTIONS, nestpipe, pinterest
        from recxla.sim.hardware import H100_P5

        comparisons = pinterest() + [
            c for c in pinterest(hw=H100_P5) if c.what.startswith("speedup after")
        ] + nestpipe()
        print("\n# published results against the model (assumptions below)")
        print(table([{"source": c.source, "what": c.what, "published": c.published,
                      "predicted": c.predicted, "miss": f"{100 * c.miss:+.0f}%"}
                     for c in comparisons], ["source", "what", "published", "predicted",
                                             "miss"]))
        for a in ASSUMPTIONS:
            print(f"- {a}")
        print_diagnostics()
    if args.check:
        from recxla.sim.check import compare_runs, load_runs

        try:
            compared = compare_runs(load_runs(args.check))
        except (OSError, ValueError) as e:  # a missing file, bad JSON, a run without a field
            return _bad_input(e)
        print("\n# measured runs against the model")
        print(table(compared, list(compared[0])) if compared else "(no runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
