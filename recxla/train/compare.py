"""`recxla-train --compare A.json B.json ... [--chart out.png]`: runs side by side.

Prints one column per metrics file (throughput, the step's time split, bytes on the wire per
step by kind, training loss, and the held-out AUC and log loss with what they were measured
on, the CPU time per step and per example), with each run's throughput and bytes as a ratio
to the first file's (the reference: list the baseline first) and, where several files are
TorchRec baseline runs, its throughput as a ratio to the fastest of them; and, with --chart
PATH, writes a PNG bar chart (matplotlib, no display needed) of examples/s, exposed
communication and wire bytes there, and says so. Without --chart it writes nothing.
"""

import argparse
import os
import sys
from typing import List, Optional, Sequence

from recxla.train.metrics import read_metrics


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="recxla-train --compare",
                                description="Compare recxla-train metrics files side by side.")
    p.add_argument("--compare", nargs="+", metavar="METRICS_JSON", required=True,
                   help="metrics files (--metrics of recxla-train); the first is the reference")
    p.add_argument("--chart", metavar="PATH",
                   help="also write a PNG bar chart of the runs here (default: no chart; '' is "
                   "none too)")
    return p


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def rows(runs: List[dict]) -> List[List[str]]:
    """The table as rows of cells: [label, value per run...]."""
    ref = runs[0]
    kinds = sorted({k for r in runs for k in r.get("wire_bytes_per_step_by_kind", {})})
    out = [
        ["run"] + [r["name"] for r in runs],
        ["ranks x batch"] + [f"{r['world_size']} x {r['config']['batch_size']}" for r in runs],
        ["examples/s (mean)"] + [f"{r['examples_per_s']:,.0f}" for r in runs],
        ["examples/s (p50)"] + [f"{r.get('examples_per_s_p50', 0):,.0f}" for r in runs],
        ["  vs first"] + [f"{r['examples_per_s'] / ref['examples_per_s']:.2f}x"
                          if ref["examples_per_s"] else "-" for r in runs],
    ]
    baselines = [r for r in runs if r.get("path") == "torchrec"]
    if len(baselines) > 1:
        fastest = max(baselines, key=lambda r: r["examples_per_s"])
        out.append([f"  vs fastest torchrec ({fastest['name']})"] + [
            f"{r['examples_per_s'] / fastest['examples_per_s']:.2f}x"
            if fastest["examples_per_s"] else "-" for r in runs])
    for key, label in (("mean", "step ms (mean)"), ("compute", "  compute ms"),
                       ("data", "  data ms"), ("exposed_comm", "  exposed comm ms"),
                       ("comm_in_flight", "  comm in flight ms")):
        out.append([label] + [f"{r['step_time_s'][key] * 1e3:.1f}" for r in runs])
    out.append(["exposed comm fraction"] + [f"{r['exposed_comm_fraction']:.1%}" for r in runs])
    # Older metrics files have no CPU time.
    out.append(["CPU ms/step (p50, rank mean)"] + [
        f"{r['cpu_s_per_step']['p50'] * 1e3:.1f}" if "cpu_s_per_step" in r else "-"
        for r in runs])
    out.append(["CPU us/example"] + [
        f"{r['cpu_us_per_example']['mean']:.1f}" if "cpu_us_per_example" in r else "-"
        for r in runs])
    out.append(["wire MB/step (all ranks)"] + [_mb(r["wire_bytes_per_step"]) for r in runs])
    out.append(["  vs first"] + [f"{r['wire_bytes_per_step'] / ref['wire_bytes_per_step']:.3f}x"
                                 if ref["wire_bytes_per_step"] else "-" for r in runs])
    for kind in kinds:
        out.append([f"  {kind} MB"] + [_mb(r.get("wire_bytes_per_step_by_kind", {}).get(kind, 0))
                                       for r in runs])
    out.append(["final loss"] + [f"{r['final_loss']:.4f}" for r in runs])
    out.append(["held-out data"] + [r.get("eval_data", "-") for r in runs])
    out.append(["  examples"] + [f"{r.get('eval_examples', 0):,}" for r in runs])
    out.append(["AUC"] + [f"{r['auc']:.4f}" for r in runs])
    out.append(["  vs first"] + [f"{r['auc'] - ref['auc']:+.4f}" for r in runs])
    if all("eval_loss" in r for r in runs):
        out.append(["log loss (held-out)"] + [f"{r['eval_loss']:.4f}" for r in runs])
        out.append(["  vs first"] + [f"{r['eval_loss'] - ref['eval_loss']:+.4f}" for r in runs])
    return out


def format_table(runs: List[dict]) -> str:
    table = rows(runs)
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = []
    for n, row in enumerate(table):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def write_chart(runs: List[dict], path: str) -> None:
    """A PNG of three bar panels: examples/s, exposed communication ms, wire MB per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in runs]
    panels = [
        ("examples/s", [r["examples_per_s"] for r in runs]),
        ("exposed comm per step (ms)", [r["step_time_s"]["exposed_comm"] * 1e3 for r in runs]),
        ("wire MB per step (all ranks)", [r["wire_bytes_per_step"] / 1e6 for r in runs]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    colors = [f"C{i}" for i in range(len(runs))]
    for ax, (title, values) in zip(axes, panels):
        bars = ax.bar(range(len(runs)), values, color=colors)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(runs)), names, rotation=20, ha="right", fontsize=8)
        ax.bar_label(bars, labels=[f"{v:,.0f}" if v >= 100 else f"{v:.3g}" for v in values],
                     fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        runs = [read_metrics(path) for path in args.compare]
        if args.chart:
            folder = os.path.dirname(os.path.abspath(args.chart))
            if not os.path.isdir(folder):
                raise ValueError(f"--chart {args.chart!r}: the folder {folder!r} does not exist")
    except ValueError as e:
        print(f"recxla-train: error: {e}", file=sys.stderr)
        return 2
    for path, run in zip(args.compare, runs):
        run.setdefault("name", os.path.basename(path))
    print(format_table(runs))
    if args.chart:
        write_chart(runs, args.chart)
        print(f"wrote {args.chart}")
    return 0
