"""The campaign's report: bench/results/gpu.json (every campaign run, newest last, each with its
commit, machine and date) and bench/results/gpu.md generated from it, also left in the
campaign's output folder (the copies that come back from the GPU machine).

A dry run writes both files to the output folder only: its figures are CPU figures of the code
path, never results.
"""

import datetime
import json
import os
from typing import List, Optional

from bench.gpu_campaign.run import ROOT, Campaign, results_json
from bench.gpu_campaign.timing import DEVICE_COPY

RESULTS_JSON = os.path.join(ROOT, "bench", "results", "gpu.json")
RESULTS_MD = os.path.join(ROOT, "bench", "results", "gpu.md")
COMMAND = "make gpu-campaign  (python3 -m bench.gpu_campaign)"
# Targets of the campaign (docs/gpu.md): codec bandwidth as a share of a device copy's,
# clustering time at batch 8192, dedup speed-up over torch.unique.
CODEC_OF_COPY = 0.85
CLUSTER_MS = 0.5
DEDUP_OVER_TORCH = 2.0


def entry(campaign: Campaign, argv: List[str]) -> dict:
    stages = results_json(campaign)
    env = stages.get("env", {}).get("data", {})
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": env.get("commit", "unknown"),
        "dry_run": campaign.dry_run,
        "machine": env,
        "command": " ".join([COMMAND] + list(argv)),
        "stages": stages,
    }


def load_history(path: str = RESULTS_JSON) -> List[dict]:
    try:
        with open(path) as f:
            return json.load(f)["runs"]
    except (OSError, ValueError, KeyError):
        return []


def write(campaign: Campaign, to_results: bool, argv: List[str]) -> None:
    runs = load_history() + [entry(campaign, argv)]
    text = markdown(runs)
    targets = [os.path.join(campaign.out, "gpu")]
    if to_results:
        targets.append(os.path.join(ROOT, "bench", "results", "gpu"))
    for base in targets:
        with open(base + ".json", "w") as f:
            json.dump({"runs": runs}, f, indent=1, sort_keys=True)
        with open(base + ".md", "w") as f:
            f.write(text)


# ---------------------------------------------------------------------------- markdown


def _stage(run: dict, name: str) -> dict:
    return run["stages"].get(name, {"status": "not run", "summary": "", "data": {}})


def _us(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.2f} ms" if value >= 1000 else f"{value:.1f} us"


def targets(run: dict) -> List[tuple]:
    """(target, measured, met) rows of one run."""
    out = []
    for backend in ("cuda", "triton"):
        s = _stage(run, f"tests-{backend}")
        d = s.get("data", {})
        failed = d.get("failures", 0) + d.get("errors", 0)
        out.append((f"every GPU test passes ({backend} backend)", s.get("summary", ""),
                    s.get("status") == "pass" and d.get("tests", 0) > 0 and not failed))
    for tool in ("memcheck", "racecheck"):
        s = _stage(run, tool)
        out.append((f"compute-sanitizer {tool}: 0 errors", s.get("summary", ""),
                    s.get("status") == "pass"))
    rows = _stage(run, "kernels").get("data", {}).get("rows", [])
    for target, measured, met in kernel_targets(rows):
        out.append((target, measured, met))
    t = _stage(run, "trainer")
    out.append(("trainer on one GPU: pipelined equals sequential, copy stream under compute",
                t.get("summary", ""), t.get("status") == "pass" and _side_share(t) is not None
                and _side_share(t) > 0))
    return out


def _side_share(stage: dict) -> Optional[float]:
    overlap = stage.get("data", {}).get("overlap") or {}
    return (overlap.get("side") or {}).get("share")


def _ok(r: dict) -> bool:
    return r.get("median_us") is not None and not r["check"].startswith("FAILED")


def kernel_targets(rows: List[dict]) -> List[tuple]:
    """The kernel targets, read from the rows by their families' conventions: a recxla
    variant's provider is `cuda:<variant>` (or `triton`), baselines are named for what they
    are; `of_copy` is the copy's time over the provider's for the same bytes."""
    out = []
    codec = [r for r in rows if r["group"].startswith(("fp8_quantize", "fp8_dequantize"))]
    for group in sorted({r["group"] for r in codec}):
        best = _best([r for r in codec if r["group"] == group and
                      r["provider"].startswith("cuda:")])
        share = best.get("of_copy") if best else None
        out.append((f"codec >= {CODEC_OF_COPY}x copy bandwidth: {group}",
                    f"{best['provider']} {share:.2f}x" if best and share else "no passing variant",
                    bool(share and share >= CODEC_OF_COPY)))
    cluster = [r for r in rows if r["group"].startswith("cluster")]
    for group in sorted({r["group"] for r in cluster}):
        best = _best([r for r in cluster if r["group"] == group and
                      r["provider"].startswith(("cuda:", "triton"))])
        out.append((f"clustering <= {CLUSTER_MS} ms: {group}",
                    f"{best['provider']} {_us(best['median_us'])}" if best else "no passing variant",
                    bool(best and best["median_us"] <= CLUSTER_MS * 1000)))
    dedup = [r for r in rows if r["group"].startswith("dedup")]
    for group in sorted({r["group"] for r in dedup}):
        best = _best([r for r in dedup if r["group"] == group and
                      r["provider"].startswith("cuda:")])
        torch_unique = _best([r for r in dedup if r["group"] == group and
                              r["provider"] == "torch.unique"])
        ratio = torch_unique["median_us"] / best["median_us"] if best and torch_unique else None
        out.append((f"dedup >= {DEDUP_OVER_TORCH}x torch.unique: {group}",
                    f"{best['provider']} {ratio:.2f}x" if ratio else "not measured",
                    bool(ratio and ratio >= DEDUP_OVER_TORCH)))
    return out


def _best(rows: List[dict]) -> Optional[dict]:
    ok = [r for r in rows if _ok(r)]
    return min(ok, key=lambda r: r["median_us"]) if ok else None


def merged(runs: List[dict]) -> dict:
    """The latest result of every stage and kernel group over `runs` of the latest run's kind
    (GPU or dry run): a rerun of a part (`--stages`, `--tests-k`, `--kernel-modules`)
    replaces only what it ran. Tests merge by test (each test's latest outcome), kernel rows by
    group, variant choices by family. -> a run-shaped dict; each stage says where it came from
    (`run`: date and commit)."""
    kind = [r for r in runs if r["dry_run"] == runs[-1]["dry_run"]]
    stages: dict = {}
    for r in kind:
        for name, s in r["stages"].items():
            if s["status"] == "skip" and name in stages:
                continue
            s = dict(s, run=f"{r['date']}, {r['commit']}")
            if name.startswith("tests-") and name in stages:
                outcomes = dict(stages[name].get("data", {}).get("outcomes", {}))
                outcomes.update(s.get("data", {}).get("outcomes", {}))
                data = _count(outcomes)
                failed = data["failures"] + data["errors"]
                s = dict(s, data=data, status="pass" if data["tests"] and not failed else "fail",
                         summary=f"{data['passed']} passed, {failed} failed, {data['skipped']} "
                                 "skipped (each test's latest outcome)")
            if name == "kernels" and name in stages:
                s = dict(s, data=_merge_kernels(stages[name].get("data", {}),
                                                s.get("data", {})))
                bad = [x for x in s["data"]["rows"] if x["check"].startswith("FAILED")]
                s["status"] = "pass" if s["data"]["rows"] and not bad else "fail"
                s["summary"] = (f"{len(s['data']['rows'])} timings, {len(bad)} failed checks "
                                "(each group's latest run)")
            stages[name] = s
    order = ("env", "build", "tests-cuda", "tests-triton", "memcheck", "racecheck", "kernels",
             "trainer")
    ranked = sorted(stages, key=lambda n: order.index(n) if n in order else len(order))
    return dict(runs[-1], stages={n: stages[n] for n in ranked})


def _count(outcomes: dict) -> dict:
    from bench.gpu_campaign.stages import count_outcomes

    return count_outcomes(outcomes)


def _merge_kernels(old: dict, new: dict) -> dict:
    groups = {x["group"] for x in new.get("rows", [])}
    families = {x["family"] for x in new.get("choices", [])}
    return {"rows": [x for x in old.get("rows", []) if x["group"] not in groups]
            + new.get("rows", []),
            "choices": [x for x in old.get("choices", []) if x["family"] not in families]
            + new.get("choices", [])}


def markdown(runs: List[dict]) -> str:
    run = merged(runs)
    m = run["machine"]
    lines = [
        "# recxla on a GPU: the campaign's report",
        "",
        "Generated by `bench/gpu_campaign/report.py` from `gpu.json` (every campaign run, newest "
        "last); do not edit by hand. How to run it and what each stage does: docs/gpu.md.",
        "",
        "Each stage's latest result (a rerun of a part replaces only that part; the `run` "
        "column says which run each came from).",
        "",
        f"Latest run: {run['date']}, commit {run['commit']}"
        + (" (**dry run on CPU: figures of the code path, not results**)" if run["dry_run"]
           else "") + ".",
        f"Machine: {m.get('device', 'no GPU')} ({m.get('nvidia_smi', '-')}), "
        f"{m.get('sms', '-')} SMs, {m.get('l2_mib', '-')} MiB L2; host {m.get('cpu', '-')}, "
        f"{m.get('cpu_cores', '-')} cores. Python {m.get('python')}, torch {m.get('torch')} "
        f"(CUDA {m.get('cuda_runtime')}), triton {m.get('triton')}, {m.get('nvcc', 'nvcc -')}.",
        f"Command: `{run['command']}`.",
        "",
        "## Stages",
        "",
        "| stage | status | seconds | summary | run |",
        "|---|---|---:|---|---|",
    ]
    for name, s in run["stages"].items():
        lines.append(f"| {name} | {s['status']} | {s['seconds']:.0f} | {s['summary']} | "
                     f"{s.get('run', '')} |")
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
    for target, measured, met in targets(run):
        lines.append(f"| {target} | {measured} | {'yes' if met else 'no'} |")
    failed = [f"`{n}` ({b})" for b in ("cuda", "triton")
              for n in _stage(run, f"tests-{b}").get("data", {}).get("failed_names", [])]
    if failed:
        lines += ["", "Failed tests (backend):", ""] + [f"- {n}" for n in failed]
    lines += _kernel_tables(_stage(run, "kernels").get("data", {}))
    lines += _trainer_section(_stage(run, "trainer"))
    lines += ["", "## Runs", "", "| date | commit | device | dry run | stages passed |",
              "|---|---|---|---|---|"]
    for r in runs:
        passed = sum(s["status"] == "pass" for s in r["stages"].values())
        lines.append(f"| {r['date']} | {r['commit']} | {r['machine'].get('device', '-')} | "
                     f"{'yes' if r['dry_run'] else 'no'} | {passed} of {len(r['stages'])} |")
    lines += ["", "The first, partial GPU run (before this campaign existed): "
              "[gpu_first_run.md](gpu_first_run.md).", ""]
    return "\n".join(lines)


def _kernel_tables(data: dict) -> List[str]:
    rows = data.get("rows", [])
    if not rows:
        return []
    lines = ["", "## Kernels", "",
             "Device-event medians (minimum beside), warm-up excluded, inputs rotated beyond the "
             "L2 cache; every recxla variant checked against the reference on fresh random inputs "
             "before it was timed. GB/s counts bytes read plus written; `of copy` is a device "
             "copy's time for the same bytes over the provider's, measured in the same process. "
             "At the trainer's message sizes (1-2 MB) a call, the copy's too, lasts about as long "
             "as its launch, and the event pair around one call also spans the host's launch of "
             "it: there `of copy` compares launch costs, not bandwidth. `back to back`: the same "
             "calls enqueued one after another between one pair of events, their mean (the "
             "device's own time where the host launches faster than the device runs), and "
             "`of copy` of that against the device copy's back-to-back time.",
             ""]
    for group in dict.fromkeys(r["group"] for r in rows):
        lines += [f"### {group}", "",
                  "| provider | median | min | GB/s | of copy | back to back | of copy, back to back "
                  "| check |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        members = [r for r in rows if r["group"] == group]
        copy = next((r.get("back_to_back_us") for r in members
                     if r["provider"] == DEVICE_COPY), None)
        for r in sorted(members, key=lambda r: (r["median_us"] is None, r["median_us"] or 0)):
            back = r.get("back_to_back_us")
            of_copy = round(copy / back, 3) if copy and back else "-"
            lines.append(f"| {r['provider']} | {_us(r['median_us'])} | {_us(r['min_us'])} | "
                         f"{r.get('gbps', '-')} | {r.get('of_copy', '-')} | {_us(back)} | "
                         f"{of_copy} | {r['check']} |")
        lines.append("")
    choices = data.get("choices", [])
    if choices:
        lines += ["### Variant choices", "",
                  "The default per architecture follows these winners "
                  "(csrc/gpu_variants.cpp, `kWinners`).", "",
                  "| family | capability | winner | why |", "|---|---|---|---|"]
        for ch in choices:
            lines.append(f"| {ch['family']} | {ch['capability']} | {ch['winner']} | "
                         f"{ch['why']} |")
    return lines


def _trainer_section(stage: dict) -> List[str]:
    data = stage.get("data", {})
    runs = data.get("runs")
    if not runs:
        return []
    lines = ["", "## Trainer", "", "| run | ex/s | final loss | held-out loss | AUC | command |",
             "|---|---:|---:|---:|---:|---|"]
    for name, r in runs.items():
        if r.get("final_loss") is None:
            lines.append(f"| {name} | failed (exit {r['returncode']}) | | | | `{r['command']}` |")
            continue
        lines.append(f"| {name} | {r['examples_per_s']:.0f} | {r['final_loss']:.6f} | "
                     f"{r['eval_loss']:.6f} | {r['auc']:.5f} | `{r['command']}` |")
    overlap = data.get("overlap") or {}
    if overlap.get("streams"):
        lines += ["", f"Stream overlap in the pipelined run's kernel trace (compute stream "
                      f"{overlap['compute_stream']}, busy {overlap['compute_busy_us']:.0f} us):",
                  "", "| stream | kind | events | busy | under compute | share |",
                  "|---|---|---:|---:|---:|---:|"]
        for s in overlap["streams"] + [dict(overlap["side"], stream="all side streams",
                                            kind="", events="")]:
            share = "-" if s["share"] is None else f"{s['share']:.0%}"
            lines.append(f"| {s['stream']} | {s['kind']} | {s['events']} | "
                         f"{s['busy_us']:.0f} us | {s['overlapped_us']:.0f} us | {share} |")
    return lines
