"""Quantized all-to-all across emulated nodes: bytes on the wire and time, fp32 vs bf16 vs FP8.

`python -m bench.cluster.run_a2a` (or `make bench-cluster`) runs, for each setting
- loopback: 2 and 4 ranks on 127.0.0.1 (one emulated node, no shaping);
- shaped: 2 emulated nodes joined by 1 Gbit/s links (see netns.py), 1 and 2 ranks per node;
a link check (raw uint8 all_to_all_single and a one-way send across the link), then
`recxla.quantized_all_to_all` on [rows_per_rank, D] float32 rows, split evenly over the ranks,
forward only and forward + backward, in every wire format, next to `torch.distributed.
all_to_all_single` of the fp32 rows (what runs without recxla; its backward is the same call on
the gradient). It prints one table and writes every figure to JSON (--json).

Per row: bytes this rank puts on the wire (rows to other ranks; rows to itself never leave the
process), the median over iterations of the slowest rank's time (every iteration starts after a
barrier), both as ratios to torch fp32, and the SQNR of the output (and of x's gradient) against
the exact fp32 exchange.

Bytes measured on the links (netns mode): the counters of every node's veth (`rx0`, see
netns.py) are read before and after each variant's iterations, so the bytes that crossed the
shaped links sit next to the bytes computed from `recxla.row_bytes`: per node and step, payload
plus TCP/IP headers and ACKs, less the traffic of the timing harness itself (its barrier and
all_reduce, measured alone and subtracted). Over plain loopback nothing is measured: `lo` is
shared with every other process on the machine.
"""

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

from bench.cluster.launch import REPO_ROOT, ClusterBusy, EmulatedCluster, benchmark_lock
from bench.cluster.rank import rank_info
from recxla.train.metrics import json_safe

# (label, fwd format, bwd format); "torch" is plain all_to_all_single of the fp32 rows.
VARIANTS = {
    "fwd": [("torch fp32", None, None), ("fp32", "fp32", "fp32"), ("bf16", "bf16", "bf16"),
            ("e4m3", "e4m3", "bf16"), ("e5m2", "e5m2", "bf16")],
    "fwd+bwd": [("torch fp32", None, None), ("fp32/fp32", "fp32", "fp32"),
                ("bf16/bf16", "bf16", "bf16"), ("e4m3/bf16", "e4m3", "bf16"),
                ("e4m3/e5m2", "e4m3", "e5m2"), ("e5m2/e5m2", "e5m2", "e5m2")],
}
# (label, nodes, ranks_per_node, tbf rate or None, harness mode)
SETTINGS = [
    ("loopback", 1, 2, None, "loopback"),
    ("loopback", 1, 4, None, "loopback"),
    ("2 nodes @ 1gbit", 2, 1, "1gbit", "auto"),
    ("2 nodes @ 1gbit", 2, 2, "1gbit", "auto"),
]


def sqnr_db(ref, out, all_ranks: bool = True) -> float:
    """Signal-to-quantization-noise ratio of `out` against `ref` in dB (inf when exact), summed
    over all ranks (all_ranks) or over this rank's rows."""
    import torch
    import torch.distributed as dist

    s = torch.stack([ref.double().square().sum(), (out.double() - ref.double()).square().sum()])
    if all_ranks:
        dist.all_reduce(s)
    return math.inf if s[1] == 0 else 10.0 * math.log10((s[0] / s[1]).item())


def make_inputs(rows_per_rank: int, dim: int, seed: int) -> dict:
    """This rank's rows, the gradient fed to backward, even splits, and the exact fp32 results.

    Returns {"x", "grad": [rows_per_rank, dim] float32; "splits": list of W ints;
    "ref_out", "ref_grad": [rows_per_rank, dim] float32, the fp32 exchange of x and of grad}.
    """
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if rows_per_rank % world:
        raise ValueError(f"run_a2a: rows_per_rank={rows_per_rank} must be a multiple of {world}")
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    # Pooled embeddings: Gaussian rows whose magnitudes spread over a few orders, as rows of
    # different tables and bag sizes do; per-row scales are what FP8 row-wise scaling is for.
    x, grad = (torch.randn(rows_per_rank, dim, generator=gen)
               * torch.exp(torch.randn(rows_per_rank, 1, generator=gen)) for _ in range(2))
    splits = [rows_per_rank // world] * world
    ref_out, ref_grad = torch.empty_like(x), torch.empty_like(x)
    dist.all_to_all_single(ref_out, x, splits, splits)
    dist.all_to_all_single(ref_grad, grad, splits, splits)
    return {"x": x, "grad": grad, "splits": splits, "ref_out": ref_out, "ref_grad": ref_grad}


def make_step(inputs: dict, backward: bool, fwd, bwd):
    """A function doing one exchange (and its backward) of inputs["x"]; it returns (output,
    x's gradient or None). fwd None: plain all_to_all_single of the fp32 rows."""
    import torch
    import torch.distributed as dist

    from recxla.distributed import quantized_all_to_all

    x, grad, splits = inputs["x"], inputs["grad"], inputs["splits"]

    def step():
        if fwd is None:
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x, splits, splits)
            if not backward:
                return out, None
            gx = torch.empty_like(grad)
            dist.all_to_all_single(gx, grad, splits, splits)
            return out, gx
        xi = x.detach().requires_grad_(backward)
        out = quantized_all_to_all(xi, splits, splits, fwd=fwd, bwd=bwd)
        if not backward:
            return out, None
        out.backward(grad)
        return out.detach(), xi.grad

    return step


def wire_bytes(inputs: dict, dim: int, backward: bool, fwd, bwd, 
               ranks_per_node: int = 0) -> int:
    """Bytes this rank sends to other ranks in one step (rows to itself stay in the process);
    with ranks_per_node > 0, only the bytes to ranks on other nodes (those cross the links)."""
    import torch.distributed as dist

    import recxla

    rank, splits = dist.get_rank(), inputs["splits"]
    if ranks_per_node > 0:
        rows = sum(n for r, n in enumerate(splits) if r // ranks_per_node != rank // ranks_per_node)
    else:
        rows = sum(splits) - splits[rank]
    total = rows * (4 * dim if fwd is None else recxla.row_bytes(dim, fwd))
    if backward:
        total += rows * (4 * dim if bwd is None else recxla.row_bytes(dim, bwd))
    return total


def make_codec(inputs: dict, backward: bool, fwd, bwd):
    """A function doing only the step's quantize and dequantize work, without communication:
    what the codec adds to an exchange when nothing overlaps it. None for plain fp32."""
    from recxla import dequantize_rows, quantize_rows

    if fwd is None:
        return None
    x, grad = inputs["x"], inputs["grad"]
    dim = x.shape[1]

    def codec():
        dequantize_rows(quantize_rows(x, fwd), dim, fwd)
        if backward:
            dequantize_rows(quantize_rows(grad, bwd), dim, bwd)

    return codec


# Ethernet (14), IPv4 (20) and TCP with timestamps (32) bytes in front of every packet's
# payload. How much payload a packet carries depends on the kernel's segmentation (a large GSO
# packet on a quiet machine, MSS-sized ones under load: 0.1% to 4.5% headers), so the payload,
# not the bytes, is what the all-to-all's bytes are compared with.
PACKET_HEADER_BYTES = 14 + 20 + 32


def _node_link_bytes() -> list:
    """[rx, tx, rx payload, tx payload] bytes of this node's link so far (payload: the bytes
    less PACKET_HEADER_BYTES a packet), read by the node's local rank 0 (the others give
    zeros); zeros everywhere outside netns mode."""
    from bench.cluster.netns import interface_bytes

    info = rank_info()
    if info.mode != "netns" or info.local_rank != 0:
        return [0, 0, 0, 0]
    c = interface_bytes(info.iface)
    return [c["rx_bytes"], c["tx_bytes"], c["rx_bytes"] - PACKET_HEADER_BYTES * c["rx_packets"],
            c["tx_bytes"] - PACKET_HEADER_BYTES * c["tx_packets"]]


def _link_bytes_per_step(before: list, after: list, steps: int) -> dict:
    """{"rx", "tx", "rx_payload", "tx_payload": [bytes per step of node n's link for every
    node]} from every rank's _node_link_bytes() before and after `steps` steps (an
    all_gather; collective)."""
    import torch
    import torch.distributed as dist

    info = rank_info()
    local = torch.tensor([a - b for a, b in zip(after, before)], dtype=torch.int64)
    table = [torch.empty_like(local) for _ in range(info.world_size)]
    dist.all_gather(table, local)
    nodes = [table[n * info.local_world_size].tolist() for n in range(info.nodes)]
    return {key: [node[i] / steps for node in nodes]
            for i, key in enumerate(("rx", "tx", "rx_payload", "tx_payload"))}


def _timed(fn, iters: int, warmup: int) -> tuple:
    """([seconds of each of `iters` calls of fn, run on all ranks at once: the slowest rank's],
    the last call's result)."""
    import torch
    import torch.distributed as dist

    times = []
    for i in range(warmup + iters):
        dist.barrier()
        t0 = time.perf_counter()
        result = fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(dt.item())
    return times, result


def rank_main(rows_per_rank: int, dim: int, passes, iters: int, warmup: int, seed: int) -> list:
    """Runs on every rank (see bench.cluster.rank); returns one record per (pass, variant)."""
    import torch
    import torch.distributed as dist

    info = rank_info()
    netns_mode = info.mode == "netns"
    inputs = make_inputs(rows_per_rank, dim, seed)
    steps = iters + warmup
    # What the timing harness alone (barrier + all_reduce each step) puts on the links, once its
    # one-time setup traffic (gloo's first collectives of a kind) is out of the way.
    _timed(lambda: None, 1, 1)
    before = _node_link_bytes()
    _timed(lambda: None, iters, warmup)
    harness = _link_bytes_per_step(before, _node_link_bytes(), steps)
    records = []
    for pass_name in passes:
        backward = pass_name == "fwd+bwd"
        for label, fwd, bwd in VARIANTS[pass_name]:
            before = _node_link_bytes()
            times, (out, gx) = _timed(make_step(inputs, backward, fwd, bwd), iters, warmup)
            link = _link_bytes_per_step(before, _node_link_bytes(), steps)
            codec = make_codec(inputs, backward, fwd, bwd)
            codec_s = statistics.median(_timed(codec, iters, warmup)[0]) if codec else 0.0
            # Computed bytes to other nodes, summed over each node's ranks.
            computed = torch.tensor(
                [float(wire_bytes(inputs, dim, backward, fwd, bwd, info.local_world_size))])
            per_rank = [torch.empty_like(computed) for _ in range(info.world_size)]
            dist.all_gather(per_rank, computed)
            node_computed = [sum(per_rank[r].item() for r in range(
                n * info.local_world_size, (n + 1) * info.local_world_size))
                for n in range(info.nodes)]
            records.append({
                "link_computed_tx_per_node": node_computed if netns_mode else None,
                "link_measured_tx_per_node": [
                    t - h for t, h in zip(link["tx"], harness["tx"])] if netns_mode else None,
                "link_measured_rx_per_node": [
                    r - h for r, h in zip(link["rx"], harness["rx"])] if netns_mode else None,
                "link_payload_tx_per_node": [
                    t - h for t, h in zip(link["tx_payload"], harness["tx_payload"])]
                if netns_mode else None,
                "link_harness_tx_per_node": harness["tx"] if netns_mode else None,
                "pass": pass_name, "variant": label, "fwd": fwd or "fp32", "bwd": bwd or "fp32",
                "impl": "torch" if fwd is None else "recxla",
                "wire_bytes_per_rank": wire_bytes(inputs, dim, backward, fwd, bwd),
                "cross_node_bytes_per_rank": wire_bytes(inputs, dim, backward, fwd, bwd,
                                                        rank_info().local_world_size),
                "median_s": statistics.median(times), "min_s": min(times), "times_s": times,
                "codec_s": codec_s,
                "sqnr_out_db": sqnr_db(inputs["ref_out"], out),
                # x's gradient is the gradient exchanged back: compare with the exact exchange.
                "sqnr_grad_db": sqnr_db(inputs["ref_grad"], gx) if backward else None,
            })
    return records


def _machine() -> dict:
    import torch

    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=REPO_ROOT, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"cpu": model, "cores": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, "commit": commit,
            # Other work on the machine shifts absolute times: record how busy it was.
            "loadavg_1m": os.getloadavg()[0]}


def check_targets(results) -> list:
    """The goals of the quantized exchange at D=128, each as (text, measured, passed): FP8
    forward rows at most 0.27x fp32's bytes, and e4m3 at least 3x faster than fp32 across a
    shaped link."""
    checks = []
    for s in results:
        for r in s["records"]:
            if r["pass"] == "fwd" and r["variant"] == "e4m3":
                where = f"{s['setting']}, {s['world_size']} ranks"
                checks.append((f"e4m3 forward bytes <= 0.27x fp32 ({where}, computed)",
                               r["bytes_ratio"], r["bytes_ratio"] <= 0.27))
                if r.get("link_bytes_ratio") is not None:
                    checks.append((f"e4m3 forward bytes <= 0.27x fp32 ({where}, measured on "
                                   "the veths)", r["link_bytes_ratio"],
                                   r["link_bytes_ratio"] <= 0.27))
                if s["mode"] == "netns":
                    checks.append((f"e4m3 forward >= 3x faster than fp32 ({where})",
                                   1 / r["time_ratio"], 1 / r["time_ratio"] >= 3.0))
    return checks


def run_setting(label, nodes, rpn, rate, mode, args) -> dict:
    world = nodes * rpn
    with EmulatedCluster(nodes, rpn, rate=rate, mode=mode) as cluster:
        link = {}
        # Raw links first: what 16 MiB per rank costs with no codec at all.
        a2a = cluster.run("bench.cluster.jobs:all_to_all_time",
                          {"bytes_per_peer": (16 << 20) // world, "iters": 5}, timeout=args.timeout)
        link["a2a_16MiB_per_rank_s"] = a2a[0]["seconds"]
        if nodes > 1:
            # One direction only, rank 0 (node 0) to the last rank (last node).
            p2p = cluster.run("bench.cluster.jobs:send_time",
                              {"nbytes": 16 << 20, "src": 0, "dst": world - 1},
                              timeout=args.timeout)
            link["send_16MiB_s"] = p2p[0]["seconds"]
            link["send_gbit_s"] = (16 << 20) * 8 / p2p[0]["seconds"] / 1e9
        kwargs = {"rows_per_rank": args.rows_per_rank, "dim": args.dim, "passes": args.passes,
                  "iters": args.iters, "warmup": args.warmup, "seed": args.seed}
        records = cluster.run("bench.cluster.run_a2a:rank_main", kwargs, timeout=args.timeout)[0]
        base = {r["pass"]: r for r in records if r["impl"] == "torch"}
        for r in records:
            b = base[r["pass"]]
            r["bytes_ratio"] = r["wire_bytes_per_rank"] / b["wire_bytes_per_rank"]
            r["time_ratio"] = r["median_s"] / b["median_s"]
            if r["link_measured_tx_per_node"] is not None:
                # Measured on the links: to torch fp32's measured bytes, and to the computed.
                r["link_bytes_ratio"] = (sum(r["link_measured_tx_per_node"])
                                         / sum(b["link_measured_tx_per_node"]))
                r["link_measured_vs_computed"] = (sum(r["link_measured_tx_per_node"])
                                                  / sum(r["link_computed_tx_per_node"]))
        return {"setting": label, "nodes": nodes, "ranks_per_node": rpn, "world_size": world,
                "rate": rate, "mode": cluster.mode, "fallback_reason": cluster.fallback_reason,
                "link": link, "records": records}


def print_table(results, out=sys.stdout) -> None:
    hdr = (f"{'setting':<22} {'W':>2} {'pass':<8} {'variant':<11} {'MiB/rank':>9} {'bytes':>6} "
           f"{'link MiB':>9} {'meas':>6} {'m/comp':>6} "
           f"{'median ms':>10} {'time':>6} {'speedup':>7} {'codec ms':>8} {'SQNR dB':>8}")
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    for s in results:
        name = s["setting"] if s["mode"] != "loopback" or s["rate"] is None else s["setting"] + "*"
        for r in s["records"]:
            sq = r["sqnr_out_db"] if r["sqnr_grad_db"] is None else min(r["sqnr_out_db"],
                                                                        r["sqnr_grad_db"])
            if r.get("link_measured_tx_per_node") is not None:
                link = (f"{sum(r['link_measured_tx_per_node']) / 2**20:>9.2f} "
                        f"{r['link_bytes_ratio']:>5.3f}x {r['link_measured_vs_computed']:>5.3f}x")
            else:
                link = f"{'-':>9} {'-':>6} {'-':>6}"
            print(f"{name:<22} {s['world_size']:>2} {r['pass']:<8} {r['variant']:<11} "
                  f"{r['wire_bytes_per_rank'] / 2**20:>9.2f} {r['bytes_ratio']:>5.3f}x {link} "
                  f"{r['median_s'] * 1e3:>10.2f} {r['time_ratio']:>5.3f}x "
                  f"{1 / r['time_ratio']:>6.2f}x {r['codec_s'] * 1e3:>8.2f} {sq:>8.1f}", file=out)
        link = ", ".join(f"{k}={v:.4g}" for k, v in s["link"].items())
        print(f"{'':<22} link: {link}", file=out)
    print("link MiB: bytes that crossed the nodes' veths per step (all nodes, measured, harness "
          "traffic subtracted); meas: that to torch fp32's; m/comp: measured / computed", file=out)
    if any(s["mode"] == "loopback" and s["rate"] for s in results):
        print("* namespaces unavailable: ran on plain loopback, NOT across shaped links", file=out)


def write_json(path: str, doc: dict) -> None:
    """Writes `doc` to `path` as strict JSON (see json_safe), creating its folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(json_safe(doc), f, indent=1, allow_nan=False)
    print(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows-per-rank", type=int, default=32768,
                   help="rows each rank sends in all (D=128 fp32: 32768 rows = 16 MiB)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--passes", default="fwd,fwd+bwd")
    p.add_argument("--settings", default="all",
                   help="comma-separated indices into SETTINGS (0-3), or 'all'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per cluster job")
    p.add_argument("--json", default=os.path.join("bench", "results", "quantized_all_to_all.json"))
    args = p.parse_args(argv)
    args.passes = [x for x in args.passes.split(",") if x]
    for x in args.passes:
        if x not in VARIANTS:
            p.error(f"--passes: each entry must be one of {sorted(VARIANTS)}, got {x!r}")
    picked = range(len(SETTINGS)) if args.settings == "all" else [
        int(i) for i in args.settings.split(",")]
    try:
        with benchmark_lock("bench.cluster.run_a2a"):
            t0 = time.time()
            load_before = os.getloadavg()[0]
            results = [run_setting(*SETTINGS[i], args) for i in picked]
    except ClusterBusy as e:
        print(e, file=sys.stderr)
        return 1
    print_table(results)
    checks = check_targets(results)
    for text, value, ok in checks:
        print(f"{'PASS' if ok else 'MISS'}  {text}: {value:.3f}")
    doc = {"command": " ".join([os.path.basename(sys.executable), "-m", "bench.cluster.run_a2a"]
                               + (argv if argv is not None else sys.argv[1:])),
           "machine": dict(_machine(), loadavg_1m_before=load_before),
           "targets": [{"check": t, "value": v, "passed": ok} for t, v, ok in checks],
           "rows_per_rank": args.rows_per_rank, "dim": args.dim,
           "iters": args.iters, "warmup": args.warmup, "wall_s": time.time() - t0,
           "results": results}
    if args.json:
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
