"""Run a function on several gloo ranks from a test, and never hang doing it.

    from distributed_utils import run_distributed

    def _body(rank, world_size, seed, n):      # module level: it is pickled by name
        torch.manual_seed(seed + rank)
        ...
        return some_picklable_value

    results = run_distributed(_body, world_size=2, args=(seed, 8))   # one result per rank

What it guarantees:
- a fresh rendezvous per call: the parent holds a TCPStore server on a free port (port 0, so two
  runs never race for the same port), the ranks join it as clients;
- a child exception comes back to the test as `DistributedTestError` with the child's own
  traceback (every failing rank's, the first to report first: the others usually fail only
  because a peer left), so pytest shows where it failed;
- timeouts on both levels: the process group gets `group_timeout` (a collective that one rank
  never joins fails instead of blocking forever), and the parent stops waiting after `timeout`,
  kills whatever is left and says which ranks did not finish;
- a child killed by a signal (gloo aborts a process on some protocol errors) is reported with its
  exit code instead of being waited for;
- one compute thread per rank: the ranks share the machine's cores;
- each rank is a fresh process with the test's environment variables, forked from a server that
  has imported torch, TorchRec and recxla once (tests/preloaded_forkserver.py): an environment
  variable that those imports read is read once, when the server starts. NCCL ranks are spawned
  instead (see _context).
"""

import datetime
import os
import time
import traceback
from multiprocessing.connection import wait as wait_connections
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import preloaded_forkserver

HOST = "127.0.0.1"


def _context(backend: str):
    """Forked from the preloaded server on CPU. NCCL ranks are spawned: on a GPU machine the
    server's imports leave CUDA initialized, and a process forked after that cannot use CUDA
    ("Cannot re-initialize CUDA in forked subprocess")."""
    if backend != "gloo":
        return mp.get_context("spawn")
    return preloaded_forkserver.context()


class DistributedTestError(AssertionError):
    """A rank failed, crashed or did not finish; the message holds the ranks' tracebacks."""


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    group_timeout: float,
    args: Sequence[Any],
    environ: dict,
    conn,
) -> None:
    initialized = False
    try:
        # The server's environment is the one pytest started with; a rank runs with the test's.
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=group_timeout)
        store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        initialized = True
        message = ("ok", fn(rank, world_size, *args))
    except BaseException as e:  # report everything, KeyboardInterrupt included
        message = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    # Report before leaving the group: a peer that fails because this rank left must not be
    # the first to report.
    try:
        conn.send(message)
    except Exception as e:  # an unpicklable result
        conn.send(("error", f"could not send the result back: {type(e).__name__}: {e}"))
    finally:
        conn.close()
        if initialized:
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    *,
    timeout: float = 120.0,
    group_timeout: float = 30.0,
    backend: str = "gloo",
) -> List[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` new processes in one process group.

    Args:
        fn: a module-level function (a rank imports it by name); its return value must pickle.
        world_size: number of ranks.
        args: extra positional arguments, picklable.
        timeout: seconds the parent waits for all ranks together before killing them.
        group_timeout: the process group's timeout: a collective blocked this long raises.
        backend: the torch.distributed backend ("gloo" on CPU).
    Returns:
        The ranks' return values, in rank order.
    Raises:
        DistributedTestError: a rank raised, died, or did not finish within `timeout`.
    """
    ctx = _context(backend)
    # The parent owns the rendezvous server, so the port stays taken until every rank has joined.
    server = dist.TCPStore(HOST, 0, None, is_master=True, wait_for_workers=False)
    procs, conns = [], {}
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_child,
            args=(fn, rank, world_size, server.port, backend, group_timeout, args,
                  dict(os.environ), child_end),
            daemon=True,
        )
        p.start()
        child_end.close()
        procs.append(p)
        conns[parent_end] = rank

    results: List[Optional[tuple]] = [None] * world_size
    arrival: List[int] = []
    deadline = time.monotonic() + timeout
    pending = dict(conns)
    try:
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for conn in wait_connections(list(pending), timeout=min(left, 1.0)):
                rank = pending.pop(conn)
                arrival.append(rank)
                try:
                    results[rank] = conn.recv()
                except EOFError:  # the child died before it could report
                    procs[rank].join(5)
                    results[rank] = ("died", f"exited with code {procs[rank].exitcode}")
    finally:
        for p in procs:
            p.join(max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in conns:
            conn.close()
        del server

    failures = []
    for rank in arrival + [r for r in range(world_size) if r not in arrival]:
        res = results[rank]
        if res is None:
            failures.append(f"rank {rank}: did not finish within {timeout:.0f} s (killed)")
        elif res[0] != "ok":
            failures.append(f"rank {rank}: {res[1]}")
    if failures:
        raise DistributedTestError(
            f"{len(failures)} of {world_size} ranks failed running {fn.__name__}:\n\n"
            + "\n\n".join(failures)
        )
    return [res[1] for res in results]

