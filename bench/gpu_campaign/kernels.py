"""`python -m bench.gpu_campaign.kernels MODULE --out FILE [--dry-run]`: one op family's kernel
stage in a process of its own (a crash or a poisoned CUDA context ends only that family).

MODULE is a module of this package with `run(device, dry_run) -> {"rows", "choices"}` (timing.py
says what a row holds): fp8_rows, dedup, cluster, embedding_bag, copy_runs. A dry run runs it
on CPU with Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is first imported).
"""

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_campaign.kernels")
    p.add_argument("module", choices=("fp8_rows", "dedup", "cluster", "embedding_bag",
                                      "copy_runs"))
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import importlib

    import torch

    module = importlib.import_module(f"bench.gpu_campaign.{args.module}")
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print(f"{args.module}: no CUDA device visible; use --dry-run on CPU", file=sys.stderr)
        return 2
    result = module.run(device, args.dry_run)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    for r in result["rows"]:
        median = "-" if r["median_us"] is None else f"{r['median_us']:.1f} us"
        print(f"{r['group']:<50} {r['provider']:<28} {median:>12}  {r['check']}")
    for ch in result["choices"]:
        print(f"choice: {ch['family']} on sm_{ch['capability']}: {ch['winner']} ({ch['why']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
