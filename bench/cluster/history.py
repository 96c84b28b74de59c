"""The cluster training benchmark's results as history: one file per cluster shape.

`python -m bench.cluster.run_train` appends each sitting (one invocation: every rate, variant
and repeat it ran) to `bench/results/training_<nodes>x<ranks per node>.json`:

    {"description": "...", "runs": [entry, ...]}          newest last
    entry = {"commit", "date", "machine", "command", "wall_s", "results": [...]}

`commit` is RECXLA_COMMIT when set, else `git rev-parse --short HEAD` with a "+" when tracked
files differ from it; `date` is UTC; `machine` is what run_a2a._machine records (CPU, cores,
kernel, Python, torch, load average before and after). `results` is what run_train measured,
per rate: {"rate", "mode", "fallback_reason", "fastest_torchrec", "runs": {variant: [the
trainer's summary of each repeat]}}. The pages show these entries through train_report.py.

The file keeps one trainer summary per line (everything above it indented), so a sitting adds
a few dozen lines and a diff shows which runs it added. What a variant's repeats share (its
configuration, plan, table bytes, command line: SETUP_KEYS) is kept once in the history's
"setups", which a rate's "setup" ({variant: id}) names, not in every summary (`compact`);
`expanded` gives the summaries whole again.
"""

import datetime
import hashlib
import json
import os
import subprocess
from typing import Dict, List, Optional

from bench.cluster.launch import REPO_ROOT

RESULTS_DIR = os.path.join(REPO_ROOT, "bench", "results")
DESCRIPTION = (
    "Every sitting of `python -m bench.cluster.run_train` on this cluster shape (nodes x ranks "
    "per node in the file name), newest last; run_train appends one entry per invocation "
    "(bench/cluster/history.py) and `python -m bench.cluster.train_report` generates the tables "
    "of bench/results/training.md from it. An entry's commit is the one the benchmark recorded "
    "(git HEAD when it ran, '+' when tracked files differed from it; RECXLA_COMMIT overrides), "
    "its date UTC. Entries with `migrated_from` were merged from the copies the benchmark wrote "
    "before this file existed (one file per sitting or per run): their figures are as written "
    "then, nothing dropped; their date is that of the git commit that added the copy (the run "
    "itself recorded none).")
# Depth (from the document) of one trainer summary: doc {runs: [entry {results: [rate {runs:
# {variant: [summary]}}]}]}. Summaries and anything deeper are written on one line.
_SUMMARY_DEPTH = 7


# The parts of a trainer summary that describe the run, not what it measured: the same for every
# repeat of a variant, mostly the same across rates and sittings, and most of a summary's bytes
# (the plan and config of 26 tables).
SETUP_KEYS = ("config", "plan", "table_wire", "argv", "embedding_dims", "sharder",
              "gradient_division", "pipeline")


def compact(doc: dict) -> dict:
    """`doc` with the SETUP_KEYS values that all repeats of a variant share kept once: in the
    history's "setups" ({id: setup}, id a digest of the setup), the rate's "setup" naming each
    variant's ({variant: id}). Idempotent; nothing is lost (`expanded`)."""
    setups = doc.setdefault("setups", {})
    for e in doc["runs"]:
        for rate in e["results"]:
            named = rate.setdefault("setup", {})
            for variant, summaries in rate["runs"].items():
                if variant in named or not summaries:
                    continue
                shared = {}
                for key in SETUP_KEYS:
                    values = [s[key] for s in summaries if key in s]
                    if len(values) == len(summaries) and all(v == values[0] for v in values):
                        shared[key] = values[0]
                if not shared:
                    continue
                text = json.dumps(shared, sort_keys=True, allow_nan=False)
                sid = hashlib.sha1(text.encode()).hexdigest()[:12]
                setups.setdefault(sid, shared)
                named[variant] = sid
                for s in summaries:
                    for key in shared:
                        del s[key]
            if not named:
                del rate["setup"]
    if not setups:
        del doc["setups"]
    return doc


def expanded(doc: dict, rate: dict) -> Dict[str, List[dict]]:
    """{variant: [summary]} of one rate's results (an entry's `results` item of history `doc`)
    with the shared setup put back in each summary: the trainer's summaries as written."""
    setups, named = doc.get("setups", {}), rate.get("setup", {})
    return {variant: [{**setups.get(named.get(variant), {}), **s} for s in summaries]
            for variant, summaries in rate["runs"].items()}


def path_for(nodes: int, ranks_per_node: int) -> str:
    """The history file of a cluster shape: bench/results/training_<nodes>x<ranks>.json."""
    return os.path.join(RESULTS_DIR, f"training_{nodes}x{ranks_per_node}.json")


def load(path: str) -> dict:
    """The history at `path` ({"description", "runs"}), empty if there is no file yet. Raises
    ValueError naming the file when it exists but is not a history (a single sitting's JSON of
    the old layout, or not JSON)."""
    if not os.path.exists(path):
        return {"description": DESCRIPTION, "runs": []}
    try:
        with open(path) as f:
            doc = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path} is not JSON ({e}): not a results history") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
        raise ValueError(f"{path} is not a results history ({{\"runs\": [entry, ...]}}): give "
                         "run_train a history file or a new path with --json")
    return doc


def run_commit() -> str:
    """RECXLA_COMMIT, else the short HEAD with '+' when tracked files differ from it."""
    if os.environ.get("RECXLA_COMMIT"):
        return os.environ["RECXLA_COMMIT"]

    def git(*args) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO_ROOT,
                              timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+" if dirty else "")) if head else "unknown"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def entry(command: str, machine: dict, wall_s: float, results: List[dict],
          commit: Optional[str] = None, date: Optional[str] = None) -> dict:
    """One sitting as a history entry; commit and date default to run_commit() and now."""
    machine = {k: v for k, v in machine.items() if k != "commit"}  # the entry's commit says it
    return {"commit": run_commit() if commit is None else commit,
            "date": utc_now() if date is None else date, "machine": machine,
            "command": command, "wall_s": wall_s, "results": results}


def append(path: str, new: dict) -> dict:
    """Appends entry `new` to the history at `path` (created if missing; written through a
    temporary file, so an interrupted write leaves the old history). Returns the history."""
    from recxla.train.metrics import json_safe  # torch: only where a sitting is recorded

    doc = load(path)
    doc["runs"].append(json_safe(new))
    write(path, compact(doc))
    return doc


def write(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(dumps(doc))
    os.replace(tmp, path)


def dumps(doc: dict) -> str:
    """The file's layout: indented down to the trainer summaries, one summary per line, and
    one shared setup per line; key order kept (a sitting's variants are listed in the order
    they ran)."""
    setups = doc.get("setups")
    text = _dump({k: v for k, v in doc.items() if k != "setups"}, 0)
    if not setups:
        return text + "\n"
    lines = [f'  {json.dumps(sid)}: {json.dumps(setup, allow_nan=False)}'
             for sid, setup in setups.items()]
    return text[:-2] + ',\n "setups": {\n' + ",\n".join(lines) + "\n }\n}\n"


def _dump(value, depth: int) -> str:
    if depth >= _SUMMARY_DEPTH or not isinstance(value, (dict, list)) or not value:
        return json.dumps(value, allow_nan=False)
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {_dump(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    items = [inner + _dump(v, depth + 1) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + pad + "]"


def select(runs: List[dict], spec: str) -> dict:
    """The entry of `runs` that `spec` names: "COMMIT" is the first entry with that commit,
    "COMMIT#K" the K-th (1-based), in history order (appending never changes what a spec
    names). Raises KeyError naming the commits on record."""
    commit, _, k = spec.partition("#")
    matches = [r for r in runs if r["commit"] == commit]
    index = int(k) if k.isdigit() else (1 if not k else 0)
    if not 1 <= index <= len(matches):
        known = ", ".join(dict.fromkeys(r["commit"] for r in runs))
        raise KeyError(f"no entry {spec!r}: {len(matches)} with commit {commit!r} "
                       f"(commits on record: {known})")
    return matches[index - 1]
