"""The generated parts of bench/results/training.md, from the cluster benchmark's history files
(bench/results/training_<nodes>x<ranks>.json, see history.py).

    .venv/bin/python -m bench.cluster.train_report            # rewrite them
    .venv/bin/python -m bench.cluster.train_report --check    # exit 1 where they differ

The page is hand-written around two kinds of generated part, each between markers that stay:

- `<!-- sittings: begin -->` ... `<!-- sittings: end -->`: every entry of every history file,
  one row each (shape, date, commit, machine, what ran, the fastest recxla variant against the
  fastest TorchRec one at each rate);
- `<!-- table FILE ENTRY RATE [COLUMNS] -->` ... `<!-- end table -->`: one rate of one entry as
  a table, one row per variant, medians over its repeats. FILE is a history file's name without
  `.json` (training_2x2), ENTRY a commit as the entry records it, "#K" for the K-th entry of
  that commit (history.select), RATE as run_train names it (1gbit, 200mbit, none), COLUMNS a
  comma-separated subset of COLUMNS below in order (default: DEFAULT_COLUMNS).

Ratios are of medians ("vs best TR": against the TorchRec variant with the highest median of
the same rate and sitting); bold marks the fastest recxla variant's first ratio. run_train
rewrites the page after it appends to a history file in bench/results.
"""

import argparse
import glob
import os
import re
import statistics
import sys
from typing import Callable, Dict, List, Optional

from bench.cluster import history

PAGE = os.path.join(history.RESULTS_DIR, "training.md")
SITTINGS_BEGIN, SITTINGS_END = "<!-- sittings: begin -->", "<!-- sittings: end -->"
TABLE = re.compile(r"<!-- table (?P<spec>[^>]*?) -->\n(?P<body>.*?)<!-- end table -->", re.S)


# ---------------------------------------------------------------------------- one sitting's figures


def median(runs: List[dict], get: Callable[[dict], Optional[float]]) -> float:
    """The median of get(run) over `runs`, runs without the figure left out (nan if none)."""
    values = [v for v in (get(r) for r in runs) if v is not None]
    return statistics.median(values) if values else float("nan")


def eps(runs: List[dict]) -> float:
    return median(runs, lambda r: r["examples_per_s"])


def exposed_of_comm(run: dict) -> float:
    """Time blocked on communication / time it was in flight (0: fully hidden)."""
    t = run["step_time_s"]
    return t["exposed_comm"] / t["comm_in_flight"] if t["comm_in_flight"] else 0.0


def fastest(rows: Dict[str, List[dict]], path: str) -> Optional[str]:
    """The variant of `path` ("torchrec" or "recxla", by its label) with the highest median
    examples/s among `rows`, None if none ran."""
    medians = {label: eps(runs) for label, runs in rows.items()
               if label.startswith(path) and runs}
    return max(medians, key=medians.get) if medians else None


def fastest_torchrec(rows: Dict[str, List[dict]]) -> Optional[str]:
    return fastest(rows, "torchrec")


# ---------------------------------------------------------------------------- columns


def _f(fmt: str, scale: float = 1.0) -> Callable[[float], str]:
    return lambda v: "-" if v != v else format(v * scale, fmt)


def _by_kind(kind: str) -> Callable[[dict], Optional[float]]:
    return lambda r: r["wire_bytes_per_step_by_kind"].get(kind, 0)


def _ratio_to(label: str):
    def cell(runs: List[dict], rows: Dict[str, List[dict]]) -> str:
        base = eps(rows[label]) if rows.get(label) else float("nan")
        return _f(".2f")(eps(runs) / base) + "x" if base == base else "-"
    return cell


def _of(get, fmt: str, scale: float = 1.0):
    return lambda runs, rows: _f(fmt, scale)(median(runs, get))


def _pair(get_a, get_b, fmt: str, scale: float):
    return lambda runs, rows: f"{_f(fmt, scale)(median(runs, get_a))} / " \
                              f"{_f(fmt, scale)(median(runs, get_b))}"


def _vs_best(runs: List[dict], rows: Dict[str, List[dict]]) -> str:
    best = fastest_torchrec(rows)
    return _ratio_to(best)(runs, rows) if best else "-"


def _run_by_run(runs: List[dict], rows) -> str:
    return " / ".join(f"{r['examples_per_s']:,.0f}" for r in runs)


# The variant that runs the model's dense part alone (run_train's "dense floor").
DENSE_FLOOR = "dense floor"


def cpu_per_example(r: dict) -> Optional[float]:
    return r.get("cpu_us_per_example", {}).get("mean")


def over_dense_floor(runs: List[dict], rows) -> Optional[float]:
    """The variant's CPU per example above the dense floor's (medians; None without a floor
    run): what its embedding work costs."""
    if not rows.get(DENSE_FLOOR):
        return None
    mine, floor = median(runs, cpu_per_example), median(rows[DENSE_FLOOR], cpu_per_example)
    return None if mine is None or floor is None else mine - floor


def _over_floor(runs: List[dict], rows) -> str:
    over = over_dense_floor(runs, rows)
    return "-" if over is None or over != over else f"{over:.1f}"


# key: (header, cell(runs of the variant, every variant's runs) -> str, is a ratio)
COLUMNS = {
    "eps": ("ex/s", _of(lambda r: r["examples_per_s"], ",.0f"), False),
    "runs": ("ex/s, run by run", _run_by_run, False),
    "best": ("vs best TR", _vs_best, True),
    "fp32": ("vs TR fp32", _ratio_to("torchrec fp32"), True),
    "bf16": ("vs TR bf16", _ratio_to("torchrec bf16"), True),
    "step": ("step ms", _of(lambda r: r["step_time_s"]["mean"], ".0f", 1e3), False),
    "compute": ("compute ms", _of(lambda r: r["step_time_s"]["compute"], ".0f", 1e3), False),
    "cpu": ("CPU us/example", _of(cpu_per_example, ".1f"), False),
    "floor": ("CPU us/example over the dense floor", _over_floor, False),
    "inflight": ("comm in flight ms",
                 _of(lambda r: r["step_time_s"]["comm_in_flight"], ".0f", 1e3), False),
    "exposed": ("exposed", _of(lambda r: r["exposed_comm_fraction"], ".0%"), False),
    "exposed_ms": ("exposed ms", _of(lambda r: r["step_time_s"]["exposed_comm"], ".0f", 1e3),
                   False),
    "exposed_comm": ("exposed / comm", _of(exposed_of_comm, ".0%"), False),
    "wire": ("wire MB/step", _of(lambda r: r["wire_bytes_per_step"], ".2f", 1e-6), False),
    "xnode": ("across nodes MB/step",
              _of(lambda r: r["cross_node_bytes_per_step"], ".2f", 1e-6), False),
    "xnode_link": ("across nodes MB/step (counted / link)",
                   _pair(lambda r: r["cross_node_bytes_per_step"],
                         lambda r: r.get("iface_tx_bytes_per_step"), ".2f", 1e-6), False),
    "emb": ("emb fwd / bwd MB/step",
            _pair(_by_kind("embeddings_fwd"), _by_kind("embeddings_bwd"), ".2f", 1e-6), False),
    "ids": ("ids MB/step", _of(_by_kind("ids"), ".2f", 1e-6), False),
    "auc": ("AUC", _of(lambda r: r.get("auc"), ".3f"), False),
}
DEFAULT_COLUMNS = ("eps", "best", "fp32", "step", "compute", "cpu", "exposed", "wire", "xnode")


def rate_of(entry: dict, rate: str) -> dict:
    for r in entry["results"]:
        if r["rate"] == rate:
            return r
    raise KeyError(f"entry {entry['commit']} ({entry['date']}) ran no rate {rate!r}: it ran "
                   + ", ".join(r["rate"] for r in entry["results"]))


def table(name: str, entry: dict, rate: str, columns=DEFAULT_COLUMNS) -> str:
    """One rate of one history entry as a markdown table, with a line saying where it is from."""
    for key in columns:
        if key not in COLUMNS:
            raise KeyError(f"unknown column {key!r}: one of {', '.join(COLUMNS)}")
    rows = {label: runs for label, runs in rate_of(entry, rate)["runs"].items() if runs}
    best_recxla = fastest(rows, "recxla")
    repeats = sorted({len(runs) for runs in rows.values()})
    stat = "one run" if repeats == [1] else f"medians of {'-'.join(map(str, repeats))} runs"
    lines = [f"`{name}.json`, {entry['commit']}, {entry['date']}: {stat} per variant; bold: the "
             "fastest recxla variant.", "",
             "| variant | " + " | ".join(COLUMNS[k][0] for k in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for label, runs in rows.items():
        cells, bolded = [], False
        for key in columns:
            cell = COLUMNS[key][1](runs, rows)
            if label == best_recxla and COLUMNS[key][2] and not bolded and cell != "-":
                cell, bolded = f"**{cell}**", True
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- every sitting


def histories(results_dir: Optional[str] = None) -> Dict[str, dict]:
    """{file name without .json: history} of every training_<N>x<R>.json in `results_dir`
    (default history.RESULTS_DIR)."""
    results_dir, out = results_dir or history.RESULTS_DIR, {}
    for path in sorted(glob.glob(os.path.join(results_dir, "training_*x*.json"))):
        name = os.path.basename(path)[:-len(".json")]
        if re.fullmatch(r"training_\d+x\d+", name):
            out[name] = history.load(path)
    return out


def _headline(result: dict) -> str:
    rows = {label: runs for label, runs in result["runs"].items() if runs}
    tr, rx = fastest(rows, "torchrec"), fastest(rows, "recxla")
    if not (tr and rx):
        return f"{result['rate']}: {rx or tr or 'nothing'} alone"
    return f"{result['rate']}: {rx} {eps(rows[rx]) / eps(rows[tr]):.2f}x {tr}"


def sittings(hists: Dict[str, dict]) -> str:
    """Every entry of every history, one row each, by shape and then as recorded."""
    lines = ["| file | date | commit | machine | runs per variant | variants | fastest recxla "
             "against the fastest TorchRec, per rate |", "|---|---|---|---|---:|---:|---|"]
    for name, hist in hists.items():
        for e in hist["runs"]:
            m = e["machine"]
            machine = (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('kernel', '?')}"
                       f", load {m.get('loadavg_1m_before', float('nan')):.1f} -> "
                       f"{m.get('loadavg_1m', float('nan')):.1f}")
            repeats = sorted({len(v) for r in e["results"] for v in r["runs"].values() if v})
            variants = len({v for r in e["results"] for v in r["runs"]})
            lines.append(f"| {name} | {e['date']} | {e['commit']} | {machine} | "
                         f"{'-'.join(map(str, repeats))} | {variants} | "
                         + "; ".join(_headline(r) for r in e["results"]) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the page


def render(text: str, hists: Dict[str, dict]) -> str:
    """`text` (the page) with every generated part rewritten from `hists`. Raises KeyError or
    ValueError naming the marker that cannot be filled."""
    def one_table(m: re.Match) -> str:
        spec = m.group("spec")
        parts = spec.split()
        if len(parts) not in (3, 4):
            raise ValueError(f"<!-- table {spec} -->: expected FILE ENTRY RATE [COLUMNS]")
        name, which, rate = parts[:3]
        if name not in hists:
            raise KeyError(f"<!-- table {spec} -->: no history {name}.json (there are: "
                           f"{', '.join(hists) or 'none'})")
        columns = tuple(parts[3].split(",")) if len(parts) == 4 else DEFAULT_COLUMNS
        body = table(name, history.select(hists[name]["runs"], which), rate, columns)
        return f"<!-- table {spec} -->\n{body}\n<!-- end table -->"

    text = TABLE.sub(one_table, text)
    if SITTINGS_BEGIN in text:
        head, rest = text.split(SITTINGS_BEGIN, 1)
        if SITTINGS_END not in rest:
            raise ValueError(f"{SITTINGS_BEGIN} without {SITTINGS_END}")
        text = (head + SITTINGS_BEGIN + "\n" + sittings(hists) + "\n" + SITTINGS_END
                + rest.split(SITTINGS_END, 1)[1])
    return text


def update(page: Optional[str] = None, results_dir: Optional[str] = None,
           check: bool = False) -> bool:
    """Rewrites the generated parts of `page` (default PAGE) from the histories in
    `results_dir` (default history.RESULTS_DIR); check: only compares. True if it was current."""
    page, results_dir = page or PAGE, results_dir or history.RESULTS_DIR
    with open(page) as f:
        text = f.read()
    new = render(text, histories(results_dir))
    if new != text and not check:
        with open(page, "w") as f:
            f.write(new)
    return new == text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--page", default=None, help=f"default: {PAGE}")
    p.add_argument("--results", default=None,
                   help=f"folder of the history files (default: {history.RESULTS_DIR})")
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 if the page's generated parts are out of date")
    args = p.parse_args(argv)
    current = update(args.page, args.results, check=args.check)
    if args.check and not current:
        print(f"{args.page or PAGE}: generated parts out of date: run python -m "
              "bench.cluster.train_report", file=sys.stderr)
        return 1
    print(f"{args.page or PAGE}: {'up to date' if current else 'rewritten'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
