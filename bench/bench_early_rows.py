"""What could leave before the update, per table, on the trainer's data: the share of the next
batch's bags that hold a row this batch read (a pooled table's late bags) and the share of each
rank's unique rows that this batch read (a row-exchange table's late rows), with
recxla.planner.early_send; and what that makes of the forward message's values (the trainer's
`--early-rows` sends the rest before the update).

    .venv/bin/python bench/bench_early_rows.py [--ranks 4] [--steps 20] [--batch-size 1024]
        [--max-rows 100000] [--zipf 1.05] [--report PATH] [--json PATH]

The data is the trainer's synthetic data as the cluster benchmark trains it (bench.cluster.
run_train's TRAIN_ARGS: batch 1024 per rank, tables of at most 100k rows), `--ranks` ranks'
batches per step. Which tables the trainer exchanges as rows is its own choice
(recxla.torchrec.choose_row_tables on rank 0's sample). The report replaces the section
"### What could leave before the update, Zipf Z" of bench/results/training.md (one per
--zipf) and the JSON (default bench/results/early_rows.json) keeps each --zipf's latest run.
--report '' / --json '' write nothing there; `main([...])` returns the results dict.
"""

import argparse
import datetime
import json
import os
import statistics
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.bench_data_pipeline import cpu_model  # noqa: E402

SECTION = "### What could leave before the update"


def section(zipf: float) -> str:
    return f"{SECTION}, Zipf {zipf:g}"


def measure(args) -> dict:
    from recxla.planner.early_send import early_send_shares
    from recxla.torchrec import choose_row_tables
    from recxla.train.data import TrainData
    from recxla.train.parse import parse_config

    config = parse_config(["--batch-size", str(args.batch_size), "--max-rows",
                           str(args.max_rows), "--zipf", str(args.zipf)])
    data = [TrainData(config, r, args.ranks) for r in range(args.ranks)]
    tables = data[0].tables()
    per_rank = [list(d.train(0, args.steps)) for d in data]
    steps = [[per_rank[r][n].sparse_features for r in range(args.ranks)]
             for n in range(args.steps)]
    row_tables = set(choose_row_tables(tables, data[0].sample().sparse_features,
                                       world_size=args.ranks))
    shares = early_send_shares(tables, steps)
    rows = []
    for t, s in zip(tables, shares):
        rows.append({"table": s.table, "dim": t.embedding_dim, "row_exchange": s.table in row_tables,
                     "unique_per_bag": s.unique_per_bag, "bags_late": s.bags_late,
                     "rows_late": s.rows_late, "bags": s.bags, "rows": s.rows})
    # The forward message's values a step: a pooled table one row per bag, a row table one
    # per unique row (times the dim); what leaves early.
    row_values = sum(r["rows"] * r["dim"] for r in rows if r["row_exchange"])
    pooled_values = sum(r["bags"] * r["dim"] for r in rows if not r["row_exchange"])
    early_row_values = sum(r["rows"] * r["dim"] * (1 - r["rows_late"]) for r in rows
                           if r["row_exchange"])
    early_pooled_values = sum(r["bags"] * r["dim"] * (1 - r["bags_late"]) for r in rows
                              if not r["row_exchange"])
    return {
        "date": datetime.date.today().isoformat(), "machine": cpu_model(),
        "command": " ".join(["bench/bench_early_rows.py", *args.argv]),
        "ranks": args.ranks, "steps": args.steps, "batch_size": args.batch_size,
        "tables": rows,
        "row_tables_early_share": early_row_values / row_values if row_values else 0.0,
        "pooled_tables_early_share": early_pooled_values / pooled_values if pooled_values
        else 0.0,
        "early_share": (early_row_values + early_pooled_values)
        / max(row_values + pooled_values, 1),
        "row_tables_share_of_forward": row_values / max(row_values + pooled_values, 1),
        "bags_late_median": statistics.median(r["bags_late"] for r in rows),
        "zipf": args.zipf,
        "rows_late_median": statistics.median(r["rows_late"] for r in rows
                                              if r["row_exchange"]) if row_values else None,
    }


def report(results: dict) -> str:
    lines = [section(results["zipf"]), "",
             f"`.venv/bin/python {results['command']}` ({results['date']}, "
             f"{results['machine']}): the trainer's synthetic data, {results['ranks']} ranks x "
             f"{results['batch_size']} samples a step (Zipf exponent {results['zipf']}), "
             f"steps 1..{results['steps'] - 1} each against the step before it.", "",
             "| table | dim | exchanged as | unique rows per bag | bags late | rows late |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results["tables"]:
        lines.append(f"| {r['table']} | {r['dim']} | {'rows' if r['row_exchange'] else 'pooled'} "
                     f"| {r['unique_per_bag']:.2f} | {r['bags_late']:.0%} | {r['rows_late']:.0%} |")
    rows_late = results["rows_late_median"]
    lines += ["",
              f"- Bags late (a bag holding a row the update changes, as if every table were "
              f"pooled): median {results['bags_late_median']:.0%} over the tables; the pooled "
              f"tables' values that can leave early: {results['pooled_tables_early_share']:.0%}.",
              "- Rows late (a row-exchange row this batch read): median "
              + ("none" if rows_late is None else f"{rows_late:.0%}")
              + f"; the row tables' values that can leave early: "
              f"{results['row_tables_early_share']:.0%}. The row tables carry "
              f"{results['row_tables_share_of_forward']:.0%} of the forward values.",
              f"- With `--early-rows`, **{results['early_share']:.0%}** of the forward message's "
              "values leave before the update (each once: the bytes do not change).", ""]
    return "\n".join(lines)


def replace_section(path: str, title: str, text: str) -> None:
    old = open(path).read() if os.path.exists(path) else ""
    if title in old:
        start = old.index(title)
        rest = old[start + len(title):]
        end = rest.find("\n#")
        tail = rest[end + 1:] if end >= 0 else ""
        new = old[:start] + text + ("\n" + tail if tail else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text
    with open(path, "w") as f:
        f.write(new)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--max-rows", type=int, default=100000)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--report", default=os.path.join(_ROOT, "bench", "results", "training.md"))
    p.add_argument("--json", default=os.path.join(_ROOT, "bench", "results", "early_rows.json"))
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.ranks < 1 or args.steps < 2:
        p.error("--ranks must be >= 1 and --steps >= 2")
    results = measure(args)
    text = report(results)
    print(text)
    if args.report:
        replace_section(args.report, section(args.zipf), text)
    if args.json:
        runs = []
        if os.path.exists(args.json):
            with open(args.json) as f:
                old = json.load(f)
            runs = [r for r in old.get("runs", []) if r.get("zipf") != args.zipf]
        with open(args.json, "w") as f:
            json.dump({"runs": sorted(runs + [results], key=lambda r: -r["zipf"])}, f, indent=1)
            f.write("\n")
    return results


if __name__ == "__main__":
    main()
