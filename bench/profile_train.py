"""Where one rank's training step spends CPU: recxla-train on one rank, under torch.profiler.

    python -m bench.profile_train --schedule sequential --steps 30
    python -m bench.profile_train --schedule fwp-dbp-m2 -- --threads 1   # trainer options after --
    python -m bench.profile_train --ranks 4 -- --threads 1 --sparse-optimizer sgd

Runs `recxla-train` in this process as a job of one rank (no communication leaves the process),
the trainer's default model and options plus the schedule's flags, and profiles the steps after
warm-up (record_shapes off). With --ranks N it runs N processes over loopback and profiles rank
0: its codec, row exchange and gloo work included (the ranks share this machine's cores, so read
the CPU shares, not the wall time). Prints the top operators and labelled ranges by self CPU time: their
share of all self CPU time recorded, milliseconds and calls per step. The profiler's own cost
inflates ops with many small calls; read the shares, not the absolute times.
"""

import argparse
import multiprocessing
import os
import socket
import sys
from typing import List

SCHEDULES = {
    "sequential": ["--micro-batches", "1", "--no-overlap", "--no-dbp"],
    "dbp": ["--micro-batches", "1"],
    "fwp-dbp-m2": ["--micro-batches", "2"],
    "torchrec": ["--baseline", "torchrec"],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def profile_run(argv: List[str], warmup: int, rank: int = 0, world: int = 1,
                port: int = 0):
    """Run recxla-train ARGV as rank `rank` of `world` (port: the rendezvous's, 0 for a free
    one); returns (key averages of the measured steps, steps), profiled on rank 0 only."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from recxla.train import cli, stages

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port or _free_port()))
    run_steps = stages.run_steps  # the name the trainer's loop stage calls
    captured = {}

    def profiled(pipeline, batches, first, last, meter, progress, on_step_done, log=None):
        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False)

        def step_done(done: int) -> None:
            on_step_done(done)
            if done == first + warmup and rank == 0:
                prof.start()

        try:
            return run_steps(pipeline, batches, first, last, meter, progress, step_done, log)
        finally:
            if rank == 0:
                prof.stop()
                captured["averages"] = prof.key_averages()
            captured["steps"] = last - first - warmup

    stages.run_steps = profiled
    try:
        assert cli.main(argv) == 0
    finally:
        stages.run_steps = run_steps
    torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
    return captured.get("averages"), captured["steps"]


def top_entries(averages, steps: int, n: int) -> List[dict]:
    """The n entries with the most self CPU time: name, share of all self CPU, ms and calls per
    step."""
    total = sum(e.self_cpu_time_total for e in averages) or 1
    rows = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [{"name": e.key, "share": e.self_cpu_time_total / total,
             "ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls_per_step": e.count / steps}
            for e in rows]


def markdown(entries: List[dict]) -> str:
    lines = ["| op or range | self CPU share | ms / step | calls / step |", "|---|---|---|---|"]
    for e in entries:
        lines.append(f"| `{e['name']}` | {e['share']:.1%} | {e['ms_per_step']:.2f} | "
                     f"{e['calls_per_step']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", choices=tuple(SCHEDULES), default="sequential")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--ranks", type=int, default=1, help="processes over loopback (rank 0 "
                   "profiled)")
    args = p.parse_args(argv)
    train = ["--steps", str(args.steps), "--warmup-steps", str(args.warmup), "--eval-batches",
             "1", "--no-progress", "--label", args.schedule, *SCHEDULES[args.schedule], *extra]
    load = os.getloadavg()
    port = _free_port()
    context = multiprocessing.get_context("spawn")
    others = [context.Process(target=profile_run, args=(train, args.warmup, r, args.ranks, port))
              for r in range(1, args.ranks)]
    for process in others:
        process.start()
    averages, steps = profile_run(train, args.warmup, 0, args.ranks, port)
    for process in others:
        process.join()
    print(f"\nrecxla-train {' '.join(train)} on {args.ranks} rank(s): {steps} steps profiled "
          f"on rank 0; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end")
    print(markdown(top_entries(averages, steps, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
