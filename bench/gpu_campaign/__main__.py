"""`python3 -m bench.gpu_campaign [--dry-run] [--out DIR] [--stages a,b] [--deadline S]`

Runs the campaign's stages (stages.py) and writes the report (report.py); prints the summary
table last. --stages reruns a part (env, build and report always run: the others need them),
--tests-k and --kernel-modules a part of a stage.
Exit status 0 when every stage that ran passed, 1 otherwise.
"""

import argparse
import os
import sys

from bench.gpu_campaign import report, stages
from bench.gpu_campaign.run import Campaign, StageResult

CORRECTNESS = ("tests-cuda", "tests-triton", "memcheck", "racecheck")
ALL_STAGES = ("env", "build") + CORRECTNESS + ("kernels", "trainer")
FUNCTIONS = {
    "env": stages.env, "build": stages.build, "tests-cuda": stages.tests_cuda,
    "tests-triton": stages.tests_triton, "memcheck": stages.memcheck,
    "racecheck": stages.racecheck, "kernels": stages.kernels, "trainer": stages.trainer,
}
# The wall-clock limit of one command on the GPU machines this project borrows is 600 s.
DEFAULT_DEADLINE_S = 540


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.gpu_campaign", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="on a machine without a GPU: run every stage that needs none")
    p.add_argument("--out", default=os.environ.get("OUT") or "build/gpu_campaign",
                   help="folder for the report and logs (default: $OUT, else build/gpu_campaign)")
    p.add_argument("--stages", default=",".join(ALL_STAGES),
                   help=f"comma-separated subset of {', '.join(ALL_STAGES)}")
    p.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                   help="seconds for the whole campaign (default %(default)s)")
    p.add_argument("--tests-k", default=None, metavar="EXPR",
                   help="rerun a part: pytest -k EXPR in the tests stages")
    p.add_argument("--kernel-modules", default=",".join(stages.KERNEL_MODULES),
                   help=f"rerun a part: the kernels stage's modules, of "
                        f"{', '.join(stages.KERNEL_MODULES)}")
    p.add_argument("--no-results", action="store_true",
                   help="do not update bench/results/gpu.md and gpu.json (a dry run never does)")
    args = p.parse_args(argv)
    wanted = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in ALL_STAGES]
    if unknown:
        p.error(f"--stages: unknown {unknown}; the stages are {', '.join(ALL_STAGES)}")
    args.stages = [s for s in ALL_STAGES if s in wanted or s in ("env", "build")]
    modules = [m.strip() for m in args.kernel_modules.split(",") if m.strip()]
    if not modules or any(m not in stages.KERNEL_MODULES for m in modules):
        p.error(f"--kernel-modules: choose from {', '.join(stages.KERNEL_MODULES)}, "
                f"got {args.kernel_modules!r}")
    args.kernel_modules = modules
    return args


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    campaign = Campaign(args.out, args.dry_run, args.deadline)
    campaign.options.update(tests_k=args.tests_k, kernel_modules=args.kernel_modules)
    for name in ("env", "build"):
        campaign.run_stage(name, FUNCTIONS[name])
    ready = all(campaign.results[n].status == "pass" for n in ("env", "build"))
    if not ready:
        for name in args.stages[2:]:
            campaign.results[name] = StageResult(
                "skip", "not run: env or build failed", name=name)
    else:
        campaign.run_parallel([(n, FUNCTIONS[n]) for n in CORRECTNESS if n in args.stages])
        for name in ("kernels", "trainer"):
            if name in args.stages:
                campaign.run_stage(name, FUNCTIONS[name])
    write_results = not args.dry_run and not args.no_results
    report.write(campaign, write_results, sys.argv[1:] if argv is None else list(argv))
    table = campaign.summary_table()
    with open(os.path.join(campaign.out, "summary.txt"), "w") as f:
        f.write(table + "\n")
    campaign.finish()
    print("\n" + table, flush=True)
    return 0 if all(r.status in ("pass", "skip") for r in campaign.results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
