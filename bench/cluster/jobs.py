"""Small rank functions for EmulatedCluster.run: a connectivity check and a link throughput probe.

They run inside a rank (see rank.py), with the gloo process group already up unless noted.
"""

import os
import socket
import statistics
import time

from bench.cluster.rank import rank_info


def hello(payload: int = 1, a2a_bytes: int = 0) -> dict:
    """Where this rank runs, and the sum of (rank + payload) over all ranks by all_reduce.
    With `a2a_bytes` > 0, also "a2a_seconds": one all_to_all_time(a2a_bytes, iters=1, warmup=0).

    Returns {"rank", "world_size", "node", "local_rank", "mode", "iface", "interfaces",
    "allreduce", "pid"}: `interfaces` lists the network interfaces this process sees (inside a
    namespace: only "lo" and "rx0"), `allreduce` is a float that every rank must agree on.
    """
    import torch
    import torch.distributed as dist

    info = rank_info()
    t = torch.tensor([float(info.rank + payload)])
    dist.all_reduce(t)
    out = {
        "rank": info.rank,
        "world_size": info.world_size,
        "node": info.node,
        "local_rank": info.local_rank,
        "mode": info.mode,
        "iface": info.iface,
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
        "allreduce": t.item(),
        "pid": os.getpid(),
    }
    if a2a_bytes > 0:
        out["a2a_seconds"] = all_to_all_time(a2a_bytes, iters=1, warmup=0)["seconds"]
    return out


def all_to_all_time(bytes_per_peer: int, iters: int = 5, warmup: int = 1) -> dict:
    """Median seconds of one uint8 all_to_all_single in which every rank sends `bytes_per_peer`
    bytes to every other rank (and to itself).

    Each iteration starts after a barrier and is timed as the slowest rank's time (a collective
    is done only when its last rank is done). Returns {"bytes_per_peer", "seconds", "all"}.
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    send = torch.randint(0, 256, (bytes_per_peer * world,), dtype=torch.uint8)
    recv = torch.empty_like(send)
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(dt.item())
    return {"bytes_per_peer": bytes_per_peer, "seconds": statistics.median(times), "all": times}


def send_time(nbytes: int, src: int = 0, dst: int = 1, iters: int = 5, warmup: int = 1) -> dict:
    """Median seconds for rank `src` to send `nbytes` to rank `dst` (one direction only, other
    ranks idle), timed from before the send to the receiver's acknowledgement arriving back.

    Returns {"nbytes", "seconds", "all"} (the same on every rank).
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    ack = torch.zeros(1)
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == src:
            dist.send(buf, dst)
            dist.recv(ack, dst)  # the data has arrived only when dst says so
        elif rank == dst:
            dist.recv(buf, src)
            dist.send(ack, src)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(dt.item())
    return {"nbytes": nbytes, "seconds": statistics.median(times), "all": times}


def fail(message: str = "failing on purpose", others_sleep: float = 0.0) -> None:
    """Raise on rank 1; the other ranks sleep `others_sleep` seconds first, as if stuck in a
    collective with it (run without a process group): exercises the launcher's error path."""
    if rank_info().rank == 1:
        raise RuntimeError(message)
    time.sleep(others_sleep)


def sleep(seconds: float) -> dict:
    """Sleep (no process group needed): exercises the launcher's timeout."""
    time.sleep(seconds)
    return {"pid": os.getpid()}
