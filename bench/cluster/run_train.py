"""The trainer across emulated nodes: recxla against the TorchRec baseline, link by link.

`python -m bench.cluster.run_train` runs `recxla-train` (TorchRec's DLRM, Criteo-like synthetic
data, TorchRec's planner) on 2 emulated nodes x 2 ranks (see netns.py), at 1 Gbit/s, at
200 Mbit/s and at 50 Mbit/s (where the link binds, as on GPU clusters), once per variant:

    torchrec fp32        the baseline: DMP + TrainPipelineSparseDist, fp32 all-to-alls, TorchRec's
                         own plan (its planner may make small tables data-parallel)
    torchrec bf16        the baseline with TorchRec's bf16 codec both ways
    torchrec bf16+AR     ... and DDP's bf16 compress hook on the dense all-reduce
    torchrec bf16+AR lite   the same in TrainPipelineSparseDistLite (one batch in flight, the
                         input dist on the step's path), TorchRec's other pipeline that runs on
                         CPU (recxla.train.loop.METERED_PIPELINES)
    torchrec bf16+PowerSGD   TorchRec's bf16 codec and torch's PowerSGD DDP hook (rank 1) on
                         the dense all-reduce: the compressed all-reduce a TorchRec user can
                         register today
    torchrec fp32 same plan   the baseline on the recxla path's plan (no data-parallel tables)
    dense floor          the same DLRM with the embedding work taken out (--dense-floor: fixed
                         pooled embeddings, no tables, no all-to-all; the dense all-reduce in
                         bf16): the machine's CPU per example for the dense part alone; every
                         row's "over floor" is its CPU per example above it
    recxla sequential    recxla's sharder, nothing overlapped: FP8 e4m3 forward, e5m2 backward,
                         dedup'd input dist, every table pooled at its owner (the dense
                         all-reduce as the trainer's defaults: bf16, by node)
    recxla no FP8 / no dedup / bf16 bwd   the same with one feature switched off
    recxla rows (+AR)    row exchange where it is smaller (--row-exchange auto), fp32 dense
                         all-reduce; +AR: bf16 (the default)
    recxla DBP           the trainer's defaults: the next batch's ids during this batch, overlap
                         on, bf16 dense all-reduce by node in 1 MB buckets, sent one by
                         one or together as measured (--ddp-bucket-merge auto); "merge
                         off" / "merge on": always one way; "4 MB buckets": the dense
                         gradients in one bucket; "ring AR":
                         the dense all-reduce as one ring over every rank instead of by node;
                         "own plan": TorchRec's own plan (--data-parallel-tables);
                         "fp8 AR": the dense all-reduce in FP8 with error feedback
                         (--dense-allreduce fp8); "dims auto": the tables whose bytes
                         dominate the wire at smaller dims (--embedding-dims auto); "fp8 AR
                         dims auto": both
    recxla FWP m=4       4 micro-batches, all-to-alls behind the dense compute, no DBP
    recxla FWP+DBP m=M   both, M = 2, 4, 8; "clustered": micro-batches by cluster_samples
    recxla 2D m=4        the all-to-alls inside each node, gradients summed across nodes
                         (every table pooled at its owner); "rows": row exchange where it is
                         smaller (--row-exchange auto), the rows' gradients summed too

Each row gives examples/s, as a ratio to the fastest TorchRec variant of the same rate and run
("vs best TR": the headline) and to TorchRec fp32, the step's compute, the CPU time per example
(every rank's process, all threads: what decides where the ranks share the cores), the time
communication is in flight, exposed communication (as a share of the step, and of the time in
flight: 0% is fully hidden), and the bytes on the wire per step: counted by the trainer's
collective meter (all ranks, and the part between nodes) and measured on the links themselves
(each node's veth tx counter over the same steps). It prints one table per rate and appends the
sitting (every run's summary, with commit, date, machine and command) to the history file of
its cluster shape, bench/results/training_<nodes>x<ranks per node>.json (history.py; --json
names another, --json '' records nothing), then regenerates the tables of
bench/results/training.md from the history files (train_report.py). --list prints the
variants' options, checked, and runs nothing.

Every variant of a rate runs on the same cluster, one after another; --repeats N runs the
whole list N times, interleaved, so that load from other jobs hits every variant alike, and the
table shows medians.
"""

import argparse
import os
import sys
import time
from typing import Dict, List

from bench.cluster import history, netns, train_report
from bench.cluster.launch import ClusterBusy, EmulatedCluster, benchmark_lock
from bench.cluster.run_a2a import _machine
from bench.cluster.train_report import exposed_of_comm as _exposed_of_comm
from bench.cluster.train_report import fastest_torchrec
from bench.cluster.train_report import median as _median

# The recxla path runs recxla's pipeline; "sequential" waits for every exchange at once (no
# overlap, no double buffering) and pools every table at its owner: the sharder alone.
_SEQ = ["--no-overlap", "--no-dbp", "--row-exchange", "off"]
_HISTORY = ["--model", "history"]
VARIANTS = {
    "torchrec fp32": ["--baseline", "torchrec"],
    "torchrec bf16": ["--baseline", "torchrec", "--baseline-comms", "bf16"],
    "torchrec bf16+AR": ["--baseline", "torchrec", "--baseline-comms", "bf16",
                         "--dense-allreduce", "bf16"],
    "torchrec bf16+AR lite": ["--baseline", "torchrec", "--baseline-comms", "bf16",
                              "--dense-allreduce", "bf16", "--baseline-pipeline",
                              "sparse_dist_lite"],
    "torchrec bf16+PowerSGD": ["--baseline", "torchrec", "--baseline-comms", "bf16",
                               "--dense-allreduce", "powersgd"],
    "torchrec fp32 same plan": ["--baseline", "torchrec", "--baseline-plan", "same"],
    train_report.DENSE_FLOOR: ["--baseline", "torchrec", "--dense-floor", "--dense-allreduce",
                               "bf16"],
    "recxla sequential": [*_SEQ],
    "recxla no FP8": [*_SEQ, "--fwd-comm", "fp32", "--bwd-comm", "fp32"],
    "recxla no dedup": [*_SEQ, "--no-dedup-ids"],
    "recxla bf16 bwd": [*_SEQ, "--bwd-comm", "bf16"],
    "recxla rows": ["--no-overlap", "--no-dbp", "--dense-allreduce", "fp32"],
    "recxla rows+AR": ["--no-overlap", "--no-dbp", "--dense-allreduce", "bf16"],
    "recxla DBP": ["--dense-allreduce", "bf16"],
    "recxla DBP ring AR": ["--dense-allreduce", "bf16", "--no-dense-allreduce-by-node"],
    "recxla DBP 4 MB buckets": ["--dense-allreduce", "bf16", "--ddp-bucket-mb", "4"],
    "recxla DBP merge off": ["--dense-allreduce", "bf16", "--ddp-bucket-merge", "off"],
    "recxla DBP merge on": ["--dense-allreduce", "bf16", "--ddp-bucket-merge", "on"],
    "recxla DBP own plan": ["--dense-allreduce", "bf16", "--data-parallel-tables"],
    "recxla DBP fp8 AR": ["--dense-allreduce", "fp8"],
    "recxla DBP dims auto": ["--dense-allreduce", "bf16", "--embedding-dims", "auto"],
    "recxla DBP fp8 AR dims auto": ["--dense-allreduce", "fp8", "--embedding-dims", "auto"],
    "recxla DBP powersgd AR": ["--dense-allreduce", "powersgd"],
    "recxla DBP powersgd AR dims auto": ["--dense-allreduce", "powersgd", "--embedding-dims",
                                         "auto"],
    "recxla DBP powersgd ring AR dims auto": ["--dense-allreduce", "powersgd",
                                              "--no-dense-allreduce-by-node",
                                              "--embedding-dims", "auto"],
    "recxla DBP powersgd AR dims auto early rows": ["--dense-allreduce", "powersgd",
                                                    "--embedding-dims", "auto", "--early-rows"],
    "recxla DBP early rows": ["--dense-allreduce", "bf16", "--early-rows"],
    "recxla DBP fp8 AR dims auto early rows": ["--dense-allreduce", "fp8", "--embedding-dims",
                                               "auto", "--early-rows"],
    "recxla FWP m=4": ["--micro-batches", "4", "--no-dbp", "--dense-allreduce", "bf16"],
    "recxla FWP+DBP m=2": ["--micro-batches", "2", "--dense-allreduce", "bf16"],
    "recxla FWP+DBP m=4": ["--micro-batches", "4", "--dense-allreduce", "bf16"],
    "recxla FWP+DBP m=8": ["--micro-batches", "8", "--dense-allreduce", "bf16"],
    "recxla m=4 clustered": ["--micro-batches", "4", "--split", "clustered",
                             "--dense-allreduce", "bf16"],
    "recxla 2D m=4": ["--micro-batches", "4", "--dense-allreduce", "bf16", "--topology", "2d",
                      "--row-exchange", "off"],
    "recxla 2D m=4 rows": ["--micro-batches", "4", "--dense-allreduce", "bf16", "--topology",
                           "2d", "--row-exchange", "auto"],
    # The sequence model (--model history): the users' histories through an
    # EmbeddingCollection; run these in a sitting of their own, whose fastest TorchRec variant
    # is then one of them (bench/results/sequence.md).
    "torchrec fp32 history": ["--baseline", "torchrec", *_HISTORY],
    "torchrec bf16+AR history": ["--baseline", "torchrec", "--baseline-comms", "bf16",
                                 "--dense-allreduce", "bf16", *_HISTORY],
    "torchrec bf16+PowerSGD history": ["--baseline", "torchrec", "--baseline-comms", "bf16",
                                       "--dense-allreduce", "powersgd", *_HISTORY],
    "recxla DBP history": ["--dense-allreduce", "bf16", *_HISTORY],
    "recxla DBP powersgd AR history": ["--dense-allreduce", "powersgd", *_HISTORY],
}
RATES = ("1gbit", "200mbit", "50mbit")  # 50 Mbit/s: the link binds, as on GPU clusters
# The setting: batch 1024 per rank, dim 64, tables of at most 100k rows, FBGEMM's (and
# recxla's) fused SGD, TorchRec's planner.
TRAIN_ARGS = ["--batch-size", "1024", "--embedding-dim", "64", "--max-rows", "100000",
              "--sparse-optimizer", "sgd", "--sharding", "auto", "--eval-batches", "2",
              "--no-progress"]


def rank_main(argv: List[str]) -> dict:
    """One rank of `recxla-train ARGV` (the launcher set torchrun's variables); returns rank
    0's summary ({} on the others)."""
    from recxla.train.cli import run
    from recxla.train.parse import parse_config
    from recxla.train.rendezvous import place_from_env

    place = place_from_env()
    summary = run(parse_config(argv), place)
    return summary if place.rank == 0 else {}


def powersgd_steady_state(variant: List[str], args) -> List[str]:
    """A PowerSGD variant's gradients travel whole for their first --powersgd-start steps
    (10), which a run's lifetime makes a rounding error and a 30-step benchmark's measured
    window would be a sixth of: both PowerSGD hooks compress from the first measured step, so
    the figures are their steady state."""
    given = [*variant, *args.train_args]
    if "powersgd" not in given or "--powersgd-start" in given:
        return []
    return ["--powersgd-start", str(args.warmup)]


def run_variant(cluster: EmulatedCluster, label: str, args, timeout: float) -> dict:
    iface = ["--net-iface", netns.IFACE] if cluster.mode == "netns" else []
    # The emulated nodes share this machine's cores: the trainer's default (cores / ranks of
    # its node) would oversubscribe them with 1 rank per node; give each rank its share.
    threads = [] if "--threads" in args.train_args else \
        ["--threads", str(max(1, (os.cpu_count() or 1) // (args.nodes * args.ranks_per_node)))]
    argv = [*TRAIN_ARGS, *threads, *args.train_args, "--steps", str(args.steps), "--warmup-steps",
            str(args.warmup), "--seed", str(args.seed), "--label", label,
            "--timeout", str(args.rank_timeout), *iface, *VARIANTS[label],
            *powersgd_steady_state(VARIANTS[label], args)]
    started = time.monotonic()
    summary = cluster.run("bench.cluster.run_train:rank_main", {"argv": argv}, timeout=timeout,
                          init_process_group=False)[0]
    summary["wall_s"] = time.monotonic() - started
    summary["argv"] = argv
    return summary


def _or_nan(value):
    return float("nan") if value is None else value


def table(rate: str, mode: str, rows: Dict[str, List[dict]]) -> str:
    """One rate's table: medians over repeats; examples/s as ratios against the fastest
    TorchRec variant's median and against TorchRec fp32's."""
    mb = lambda x: f"{x / 1e6:7.2f}"  # noqa: E731
    eps_of = lambda label: _median(rows[label], lambda r: r["examples_per_s"]) \
        if rows.get(label) else float("nan")  # noqa: E731
    best = fastest_torchrec(rows)
    best_eps = eps_of(best) if best else float("nan")
    fp32_eps = eps_of("torchrec fp32")
    head = (f"{'variant':<24}{'ex/s':>9}{'vs best TR':>11}{'vs TR fp32':>11}{'step ms':>9}"
            f"{'compute':>9}{'CPU us/ex':>10}{'in flight':>10}{'exposed':>9}{'exp/comm':>9}"
            f"{'wire MB':>9}{'x-node MB':>10}{'link MB':>9}{'emb fwd':>8}{'emb bwd':>8}"
            f"{'ids':>7}{'AUC':>7}{'over floor':>11}")
    lines = [f"{rate} ({mode}; medians of {max(len(v) for v in rows.values())} runs; MB per "
             f"step, all ranks; best TR: {best or 'no TorchRec variant run'})", head,
             "-" * len(head)]
    for label, runs in rows.items():
        eps = _median(runs, lambda r: r["examples_per_s"])
        kind = lambda k: _median(runs, lambda r: r["wire_bytes_per_step_by_kind"].get(k, 0))  # noqa
        link = _median(runs, lambda r: r.get("iface_tx_bytes_per_step"))
        lines.append(
            f"{label:<24}{eps:>9,.0f}{eps / best_eps:>10.2f}x{eps / fp32_eps:>10.2f}x"
            f"{_median(runs, lambda r: r['step_time_s']['mean']) * 1e3:>9.0f}"
            f"{_median(runs, lambda r: r['step_time_s']['compute']) * 1e3:>9.0f}"
            f"{_median(runs, lambda r: r.get('cpu_us_per_example', {}).get('mean')):>10.1f}"
            f"{_median(runs, lambda r: r['step_time_s']['comm_in_flight']) * 1e3:>10.0f}"
            f"{_median(runs, lambda r: r['exposed_comm_fraction']):>9.0%}"
            f"{_median(runs, _exposed_of_comm):>9.0%}"
            f"{mb(_median(runs, lambda r: r['wire_bytes_per_step']))}  "
            f"{mb(_median(runs, lambda r: r['cross_node_bytes_per_step']))} "
            f"{mb(link) if link == link else '      -'}"
            f"{mb(kind('embeddings_fwd'))}{mb(kind('embeddings_bwd'))}"
            f"{kind('ids') / 1e6:>7.2f}{_median(runs, lambda r: r['auc']):>7.3f}"
            f"{_or_nan(train_report.over_dense_floor(runs, rows)):>11.1f}")
    return "\n".join(lines)


def list_variants(labels: List[str], args) -> int:
    """Print each variant's options after recxla-train has checked them (no process group)."""
    from recxla.train.parse import parse_config

    os.environ["LOCAL_WORLD_SIZE"] = str(args.ranks_per_node)  # as the launcher sets it
    for label in labels:
        argv = [*TRAIN_ARGS, *args.train_args, "--steps", str(args.steps), "--warmup-steps",
                str(args.warmup), *VARIANTS[label], *powersgd_steady_state(VARIANTS[label], args)]
        config = parse_config(argv)  # exits 2 naming the option on a bad one
        print(f"{label:<24}{config.path:<9}{' '.join(VARIANTS[label])}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default=",".join(RATES),
                   help="tbf rates, comma-separated ('none': unshaped links)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated, from: " + ", ".join(VARIANTS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--mode", choices=("auto", "netns", "loopback"), default="auto")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per trainer run")
    p.add_argument("--rank-timeout", type=float, default=120.0, help="the trainer's --timeout")
    p.add_argument("--train-args", default="", help="extra recxla-train options")
    p.add_argument("--json", default=None,
                   help="the history file to append this sitting to (default: bench/results/"
                        "training_<nodes>x<ranks-per-node>.json; '' records nothing)")
    p.add_argument("--list", action="store_true",
                   help="print each variant's recxla-train options, checked, and run nothing")
    args = p.parse_args(argv)
    args.train_args = args.train_args.split()
    labels = [v for v in args.variants.split(",") if v]
    for v in labels:
        if v not in VARIANTS:
            p.error(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    if args.list:
        return list_variants(labels, args)
    if args.json is None:
        args.json = history.path_for(args.nodes, args.ranks_per_node)
    if args.json:
        try:  # refuse a file that is not a history now, not after the sitting
            history.load(args.json)
        except ValueError as e:
            p.error(f"--json: {e}")
    try:
        with benchmark_lock("bench.cluster.run_train"):
            return _run(labels, args, argv)
    except ClusterBusy as e:
        print(e, file=sys.stderr)
        return 1


def _run(labels: List[str], args, argv) -> int:
    load_before, t0 = os.getloadavg()[0], time.time()
    results = []
    for rate in [r for r in args.rates.split(",") if r]:
        shaped = None if rate == "none" else rate
        with EmulatedCluster(args.nodes, args.ranks_per_node, rate=shaped, mode=args.mode) as c:
            rows: Dict[str, List[dict]] = {v: [] for v in labels}
            for _ in range(args.repeats):
                for label in labels:
                    rows[label].append(run_variant(c, label, args, args.timeout))
                    print(f"{rate} {label}: {rows[label][-1]['examples_per_s']:,.0f} ex/s",
                          file=sys.stderr, flush=True)
            results.append({"rate": rate, "mode": c.mode, "fallback_reason": c.fallback_reason,
                            "fastest_torchrec": fastest_torchrec(rows), "runs": rows})
            print(table(rate, c.mode, rows), flush=True)
    if args.json:
        record(args.json, history.entry(
            command=" ".join(["python", "-m", "bench.cluster.run_train"]
                             + (argv if argv is not None else sys.argv[1:])),
            machine=dict(_machine(), loadavg_1m_before=load_before),
            wall_s=time.time() - t0, results=results))
    return 0


def record(path: str, entry: dict) -> None:
    """Appends `entry` to the history at `path`; if that is one of bench/results' history files,
    regenerates the page's tables (a page that cannot be regenerated is reported, not fatal:
    the sitting is already recorded)."""
    doc = history.append(path, entry)
    print(f"appended the sitting to {path} (entry {len(doc['runs'])}, commit {entry['commit']})")
    if os.path.dirname(os.path.abspath(path)) != os.path.abspath(history.RESULTS_DIR):
        return
    try:
        current = train_report.update()
    except (KeyError, ValueError, OSError) as e:
        print(f"{train_report.PAGE} not regenerated: {e}", file=sys.stderr)
        return
    print(f"{train_report.PAGE}: {'up to date' if current else 'tables regenerated'}")


if __name__ == "__main__":
    sys.exit(main())
