"""`python -m recxla.demo` (what `make demo` runs): the quantized all-to-all at work on 2 gloo ranks.

Each rank holds pooled-embedding-like rows (D = 128, magnitudes varying from row to row) and
exchanges them with recxla.quantized_all_to_all in each wire format. For every format it prints
the bytes that cross between the ranks, the error against the same exchange in fp32 (relative
error and SQNR) and the time per call, next to torch's plain fp32 all_to_all_single.

Options: --rows N (rows per rank), --dim D, --iters K (timed calls per format).
"""

import argparse
import datetime
import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"
WORLD = 2
FORMATS_SHOWN = ("fp32", "bf16", "e5m2", "e4m3")


def _time_calls(fns, iters):
    """Median seconds per call of each fn. The fns take turns (a slow patch of a shared machine
    hits them all alike), and a barrier first makes every call start together on both ranks."""
    times = {name: [] for name in fns}
    for i in range(iters + 2):
        for name, fn in fns.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            if i >= 2:  # the first two warm up
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _global_sum(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def _rank_main(rank, port, rows, dim, iters):
    import recxla

    torch.set_num_threads(1)  # two ranks on a small machine: one core each
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore(HOST, port, WORLD, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    torch.manual_seed(rank)
    x = torch.randn(rows, dim) * torch.exp(torch.randn(rows, 1))
    # Uneven on purpose: rank 0 keeps a quarter of its rows, rank 1 three quarters.
    keep = rows // 4 if rank == 0 else 3 * rows // 4
    ins = [keep, rows - keep] if rank == 0 else [rows - keep, keep]
    m = torch.tensor(ins)
    table = [torch.empty_like(m) for _ in range(WORLD)]
    dist.all_gather(table, m)
    outs = [int(table[src][rank]) for src in range(WORLD)]
    crossing_rows = sum(ins) - ins[rank]  # rows this rank sends to the other rank

    ref = torch.empty(sum(outs), dim)
    dist.all_to_all_single(ref, x, outs, ins)
    ref_energy = _global_sum(ref.double().pow(2).sum().item())
    fp32_bytes = _global_sum(crossing_rows * dim * 4)

    def a2a(fmt, validate=True):
        return lambda: recxla.quantized_all_to_all(x, outs, ins, fwd=fmt, validate_splits=validate)

    fns = {fmt: a2a(fmt) for fmt in FORMATS_SHOWN}
    fns["torch"] = lambda: dist.all_to_all_single(ref, x, outs, ins)
    fns["e4m3, no validation"] = a2a("e4m3", validate=False)
    times = _time_calls(fns, iters)
    lines = []
    for fmt in FORMATS_SHOWN:
        err = _global_sum((fns[fmt]().double() - ref.double()).pow(2).sum().item())
        wire = _global_sum(crossing_rows * recxla.row_bytes(dim, fmt))
        rel = math.sqrt(err / ref_energy)
        sqnr = 10 * math.log10(ref_energy / err) if err > 0 else math.inf
        lines.append((fmt, wire, wire / fp32_bytes, rel, sqnr, times[fmt]))
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return
    print(f"recxla quantized all-to-all: 2 gloo ranks, {rows} rows x D={dim} per rank "
          f"(fp32 {rows * dim * 4 / 2**20:.1f} MiB), uneven splits, median of {iters} calls")
    print(f"{'format':<8}{'wire bytes':>12}{'vs fp32':>9}{'rel err':>11}{'SQNR dB':>9}"
          f"{'ms/call':>9}")
    for fmt, wire, ratio, rel, sqnr, t in lines:
        print(f"{fmt:<8}{int(wire):>12,}{ratio:>9.3f}{rel:>11.2e}{sqnr:>9.1f}{t * 1e3:>9.2f}")
    print(f"{'torch':<8}{int(fp32_bytes):>12,}{1:>9.3f}{0:>11.2e}{'inf':>9}"
          f"{times['torch'] * 1e3:>9.2f}   (plain fp32 all_to_all_single)")
    t_plain = times["e4m3, no validation"]
    print(f"split validation (validate_splits=True, one small all_gather): "
          f"{(times['e4m3'] - t_plain) * 1e3:+.2f} ms per e4m3 call ({t_plain * 1e3:.2f} ms "
          "without it)")
    print("wire bytes: rows crossing between the two ranks; FP8 rows are D codes + a 4-byte scale."
          " Over loopback the copy is cheap; on a real network the time follows the bytes.")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    if args.rows < 4 or args.dim < 1 or args.iters < 1:
        parser.error("--rows must be >= 4, --dim and --iters >= 1")
    # The parent holds the rendezvous server on a free port until both ranks have joined. It
    # listens on HOST only (torch's own server would listen on every interface, unauthenticated).
    from recxla.train.rendezvous import listening_socket

    sock = listening_socket(HOST, 0)
    server = dist.TCPStore(HOST, sock.getsockname()[1], None, is_master=True,
                           wait_for_workers=False, master_listen_fd=sock.detach())
    mp.spawn(_rank_main, args=(server.port, args.rows, args.dim, args.iters), nprocs=WORLD)


if __name__ == "__main__":
    main()
