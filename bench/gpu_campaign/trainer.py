"""Campaign stage: the trainer on one GPU, pipelined against its sequential schedule.

    python -m bench.gpu_campaign.trainer --out trainer.json --work DIR [--dry-run]

Three runs of `python -m recxla.train` (torchrun, one rank, the same seed, data and model):
- pipelined: 2 micro-batches, all-to-alls overlapped, the next batch prepared during this one
  (DBP), its host-to-device copies on the pipeline's copy stream; with --kernel-trace;
- sequential: one micro-batch, no overlap, no DBP;
- pipelined, batches inline: the pipelined run with the synthetic batches made on the rank's
  own thread (--loader-workers 0) instead of by a worker process (the GPU's default): the
  examples/s it loses is what making a batch costs the host's critical path;
- the sequence model (--model history: the users' histories through recxla's
  EmbeddingCollection sharder), pipelined and sequential.
All send every wire in fp32 and train with SGD (EXACT: why below), and they must agree to
float rounding (training loss over the last steps, held-out loss and AUC: relative differences
below EQUAL_RTOL); the trace gives the share of the copy and communication streams' busy time
that runs under compute-stream kernels (trace_overlap.py). Where the pipelined run differs
from the sequential one, each of its features runs alone (FEATURES_ALONE: micro-batches
without DBP, DBP with one micro-batch) and the report gives each one's difference from the
sequential run: which feature makes it.
A dry run does the same on CPU with 2 gloo ranks, the small profile and a few steps (the CPU
trace has no device streams: the overlap is then reported as absent, not as zero).
"""

import argparse
import json
import os
import subprocess
import sys
import time

from bench.gpu_campaign import trace_overlap

# Float rounding only: the micro-batches sum the same gradients in another order.
EQUAL_RTOL = 1e-4
# The check compares schedules, so both runs avoid what turns float rounding differences into
# large ones: FP8/bf16 wires (a rounding difference becomes a step of 2**-4 / 2**-8) and Adagrad,
# whose first update of a weight is lr * g / |g|: a gradient that cancels to near 0 changes the
# sign of a full step with its rounding. With the trainer's defaults (Adagrad) 24 steps on CPU
# ended 9e-4 apart in held-out loss, with SGD 5e-8 (criteo profile, batch 4096, one rank).
EXACT = ["--fwd-comm", "fp32", "--bwd-comm", "fp32", "--dense-allreduce", "fp32",
         "--dense-optimizer", "sgd", "--sparse-optimizer", "sgd", "--dense-lr", "0.5",
         "--sparse-lr", "1.0"]
GPU_ARGS = ["--device", "cuda", "--batch-size", "4096", "--steps", "24", "--warmup-steps", "8",
            "--eval-batches", "4"]
CPU_ARGS = ["--device", "cpu", "--profile", "small", "--batch-size", "64", "--steps", "5",
            "--warmup-steps", "1", "--eval-batches", "1", "--threads", "1"]
PIPELINED = ["--micro-batches", "2", "--overlap", "--dbp"]
SEQUENTIAL = ["--micro-batches", "1", "--no-overlap", "--no-dbp"]
HISTORY = ["--model", "history"]
RUNS = {
    "pipelined": PIPELINED,
    "sequential": SEQUENTIAL,
    "pipelined, batches inline": PIPELINED + ["--loader-workers", "0"],
    "history pipelined": PIPELINED + HISTORY,
    "history sequential": SEQUENTIAL + HISTORY,
}
# Run only where the pipelined run differs from the sequential one (two more runs).
FEATURES_ALONE = {
    "micro-batches alone": ["--micro-batches", "2", "--no-overlap", "--no-dbp"],
    "dbp alone": ["--micro-batches", "1", "--overlap", "--dbp"],
}
COMPARED = ("final_loss", "eval_loss", "auc")


def _run(name: str, args, work: str, nproc: int, timeout: float) -> dict:
    name = name.replace(", ", "_").replace(" ", "_")
    metrics = os.path.join(work, f"trainer_{name}.json")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "recxla.train", *args, "--seed", "0",
            "--no-progress", "--metrics", metrics]
    began = time.monotonic()
    with open(os.path.join(work, f"trainer_{name}.log"), "w") as log:
        log.write(" ".join(argv) + "\n")
        log.flush()
        try:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    out = {"command": " ".join(argv[1:]), "returncode": rc,
           "seconds": round(time.monotonic() - began, 1)}
    if rc == 0 and os.path.exists(metrics):
        with open(metrics) as f:
            m = json.load(f)
        out.update({k: m.get(k) for k in ("final_loss", "eval_loss", "auc", "examples_per_s",
                                            "exposed_comm_fraction", "device", "pipeline")})
    return out


def _relative(a, b) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def _difference(a: dict, b: dict) -> float:
    """The largest relative difference of two finished runs' COMPARED figures."""
    return max(_relative(a[k], b[k]) for k in COMPARED)


def _finished(run: dict) -> bool:
    return run["returncode"] == 0 and run.get("final_loss") is not None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_campaign.trainer")
    p.add_argument("--out", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    base, nproc = (CPU_ARGS, 2) if args.dry_run else (GPU_ARGS, 1)
    base = base + EXACT
    trace_path = os.path.join(args.work, "kernel_trace.json.gz")
    # 45 s a run on the GPU (it took 20-25 s there); a loaded CPU gets more.
    timeout = 110 if args.dry_run else 45
    runs = {}
    for name, extra in RUNS.items():
        more = ["--kernel-trace", trace_path] if name == "pipelined" else []
        runs[name] = _run(name, base + extra + more, args.work, nproc, timeout)
    result = {"runs": runs, "status": "fail"}
    done = all(_finished(r) for r in runs.values())
    if not done:
        failed = [n for n, r in runs.items() if r["returncode"] != 0]
        result["summary"] = f"runs that failed: {failed} (trainer_<run>.log)"
    else:
        a, b, inline = runs["pipelined"], runs["sequential"], runs["pipelined, batches inline"]
        diffs = {k: max(_relative(a[k], b[k]), _relative(a[k], inline[k])) for k in COMPARED}
        result["relative_differences"] = diffs
        history = _difference(runs["history pipelined"], runs["history sequential"])
        result["history_relative_difference"] = history
        equal = all(d <= EQUAL_RTOL for d in diffs.values()) and history <= EQUAL_RTOL
        alone = ""
        if _difference(a, b) > EQUAL_RTOL:
            result["features_alone"] = {}
            for name, extra in FEATURES_ALONE.items():
                runs[name] = run = _run(name, base + extra, args.work, nproc, timeout)
                result["features_alone"][name] = _difference(run, b) if _finished(run) else None
            alone = "; against sequential: " + ", ".join(
                f"{name} {'did not finish' if d is None else f'{d:.1e}'}"
                for name, d in result["features_alone"].items())
        overlap = None
        if os.path.exists(trace_path):
            overlap = trace_overlap.stream_overlap(trace_overlap.load(trace_path))
        result["overlap"] = overlap
        side = overlap["side"] if overlap else None
        share = "no device streams in the trace" if not side or side["share"] is None else \
            f"{side['share']:.0%} of the side streams' {side['busy_us']:.0f} us under compute"
        result["status"] = "pass" if equal else "fail"
        result["summary"] = (
            f"pipelined {'equals' if equal else 'DIFFERS FROM'} sequential and inline batches "
            f"(max relative difference {max(diffs.values()):.1e}); {a['examples_per_s']:.0f} vs "
            f"{b['examples_per_s']:.0f} ex/s ({inline['examples_per_s']:.0f} with the batches "
            f"made inline); {share}{alone}; the history model: pipelined "
            f"{'equals' if history <= EQUAL_RTOL else 'DIFFERS FROM'} sequential ({history:.1e}), "
            f"{runs['history pipelined']['examples_per_s']:.0f} vs "
            f"{runs['history sequential']['examples_per_s']:.0f} ex/s")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(result["summary"], flush=True)
    return 0 if result["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
