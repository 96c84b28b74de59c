"""The tables of bench/results/quantized_all_to_all.md, from the JSON that run_a2a writes.

    .venv/bin/python -m bench.cluster.a2a_report bench/results/quantized_all_to_all.json

Per setting, one markdown table: bytes computed from recxla.row_bytes (per rank, and the part that
crosses nodes), bytes measured on the nodes' veths (netns mode: per node and step, harness
traffic subtracted, as a ratio to torch fp32's measured bytes and to the computed bytes), the
median step time and its ratio to torch fp32, the codec alone, and the SQNR.
"""

import json
import sys


def _sqnr(r) -> str:
    def one(v):
        return "exact" if v in ("inf", float("inf")) else f"{v:.1f}"

    out = one(r["sqnr_out_db"])
    return out if r["sqnr_grad_db"] is None else f"{out} / {one(r['sqnr_grad_db'])}"


def setting_table(s: dict) -> str:
    """One setting of run_a2a's results as a markdown table."""
    measured = s["mode"] == "netns"
    head = ("| pass | variant (fwd/bwd) | computed MiB/rank | of which cross-node | bytes vs fp32 "
            + ("| measured on the links, MiB/node | measured vs fp32 | measured / computed "
               if measured else "")
            + "| median ms | speedup vs fp32 | codec-only ms | SQNR out / grad dB |")
    cols = head.count("|") - 1
    lines = [head, "|---|---|" + "---:|" * (cols - 2)]
    for r in s["records"]:
        cells = [r["pass"], r["variant"], f"{r['wire_bytes_per_rank'] / 2**20:.2f}",
                 f"{r['cross_node_bytes_per_rank'] / 2**20:.2f}", f"{r['bytes_ratio']:.3f}x"]
        if measured:
            per_node = r["link_measured_tx_per_node"]
            cells += [f"{sum(per_node) / len(per_node) / 2**20:.3f}",
                      f"{r['link_bytes_ratio']:.4f}x", f"{r['link_measured_vs_computed']:.4f}x"]
        cells += [f"{r['median_s'] * 1e3:.1f}", f"{1 / r['time_ratio']:.2f}x",
                  f"{r['codec_s'] * 1e3:.1f}", _sqnr(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(doc: dict) -> str:
    parts = []
    m = doc["machine"]
    parts.append(f"`{doc['command']}` on {m['cpu']} ({m['cores']} cores), commit {m['commit']}, "
                 f"load average {m['loadavg_1m_before']:.1f} before and {m['loadavg_1m']:.1f} "
                 f"after; {doc['rows_per_rank']} rows x D={doc['dim']} float32 per rank, medians "
                 f"of {doc['iters']} iterations after {doc['warmup']} warm-up ones.")
    for s in doc["results"]:
        title = (f"### {s['setting']}, {s['world_size']} ranks ({s['nodes']} node(s) x "
                 f"{s['ranks_per_node']}), mode `{s['mode']}`")
        if s.get("fallback_reason"):
            title += f" (fallback: {s['fallback_reason']})"
        link = ", ".join(f"{k} = {v:.4g}" for k, v in s["link"].items())
        parts += [title, f"Link: {link}", setting_table(s)]
    parts.append("| target | value | |\n|---|---:|---|\n" + "\n".join(
        f"| {t['check']} | {t['value']:.3f} | {'met' if t['passed'] else 'missed'} |"
        for t in doc["targets"]))
    return "\n\n".join(parts)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m bench.cluster.a2a_report RESULTS.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        print(report(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
