"""Launch a job of `nodes` x `ranks_per_node` gloo ranks on one machine and collect its results.

```
from bench.cluster import EmulatedCluster

with EmulatedCluster(nodes=2, ranks_per_node=2, rate="1gbit") as cluster:
    print(cluster.mode)                    # "netns", or "loopback" after a fallback
    results = cluster.run("my.module:rank_main", {"rows": 8192}, timeout=120)
    # results[r] is what rank r's rank_main(rows=8192) returned (JSON).
```

Each rank is a fresh `python -m bench.cluster.rank` process (see rank.py) started inside its
node's namespace with `ip netns exec`, in its own session so that it can be ended as a group, with
MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node)
and GLOO_SOCKET_IFNAME set. Ranks are placed node-major: ranks 0..R-1 on node 0, and so on.

Modes: "netns" builds the topology of netns.py or raises; "loopback" runs every rank on
127.0.0.1 with no shaping; "auto" (the default) tries "netns" and, when it is not possible here,
says why on stderr and falls back to "loopback". The topology is built once and serves every
`run()`; it is removed, and every rank still alive is ended, when the `with` block exits for any
reason: an error, a timeout, Ctrl-C, or SIGTERM/SIGHUP (turned into an exception while the
cluster is open). An interpreter exit without the block closing is covered by atexit.
"""

import atexit
import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

from bench.cluster import netns

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ("auto", "netns", "loopback")


class ClusterJobError(RuntimeError):
    """A rank exited with an error or without a result; the message holds its stderr tail."""


class ClusterTimeout(ClusterJobError):
    """The job ran past its timeout; every rank was ended."""


class ClusterBusy(ClusterJobError):
    """Another emulated-cluster benchmark is running on this machine."""


BENCHMARK_LOCK = os.path.join(tempfile.gettempdir(), "recxla-cluster-benchmark.lock")


@contextlib.contextmanager
def benchmark_lock(what: str, path: str = BENCHMARK_LOCK):
    """Holds this machine's cluster-benchmark lock while `what` runs. Two emulated-cluster
    benchmarks at once share the cores and the links' shaping, and both report wrong figures;
    the second one fails at once, naming the first, instead of waiting or measuring.
    The kernel drops the lock when its holder exits, however it ends."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 500, 0).decode(errors="replace").strip() or "unknown"
            raise ClusterBusy(f"{what}: another emulated-cluster benchmark is running ({holder}; "
                              f"lock {path}); with both at once the figures of both would be "
                              "wrong, so wait for it to end") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {what}".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def free_port() -> int:
    """A TCP port that is free on the host's loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


class _Terminated(BaseException):
    """Raised from a SIGTERM/SIGHUP handler so that the cleanup in __exit__ runs."""


class EmulatedCluster:
    """A cluster of `nodes` emulated nodes with `ranks_per_node` ranks each.

    Args:
        nodes, ranks_per_node: ints >= 1.
        rate: tbf rate of every node's link, in tc syntax ("1gbit", "100mbit"); None: unshaped.
        mode: "auto", "netns" or "loopback" (see the module docstring).
        burst, latency: tbf's burst and latency (see netns.Topology).
        threads_per_rank: torch/OpenMP threads of each rank; default: cores // ranks, at least 1
            (every rank shares this machine's cores).
    """

    def __init__(
        self,
        nodes: int = 1,
        ranks_per_node: int = 2,
        rate: Optional[str] = "1gbit",
        mode: str = "auto",
        burst: str = "256kb",
        latency: str = "100ms",
        threads_per_rank: Optional[int] = None,
    ):
        for name, value in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EmulatedCluster: {name} must be an int >= 1, got {value!r}")
        if nodes > netns.MAX_NODES:
            raise ValueError(
                f"EmulatedCluster: nodes must be at most {netns.MAX_NODES}, got {nodes}")
        if mode not in MODES:
            raise ValueError(f"EmulatedCluster: mode must be one of {MODES}, got {mode!r}")
        self.nodes, self.ranks_per_node, self.rate = nodes, ranks_per_node, rate
        self.requested_mode = mode
        self.mode: Optional[str] = None
        self.fallback_reason: Optional[str] = None
        self.world_size = nodes * ranks_per_node
        cores = os.cpu_count() or 1
        self.threads_per_rank = threads_per_rank or max(1, cores // self.world_size)
        self.topology = netns.Topology(nodes, rate=rate, burst=burst, latency=latency)
        self._procs: List[Tuple[int, subprocess.Popen]] = []  # (rank, process) now running
        #: pids of every rank process this cluster has started, for checks after the fact.
        self.started_pids: List[int] = []
        self._workdir: Optional[tempfile.TemporaryDirectory] = None
        self._old_handlers: Dict[int, Any] = {}
        self._next_port = 29500

    # -- lifetime ---------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        self._install_signal_handlers()
        atexit.register(self.close)
        try:
            self._workdir = tempfile.TemporaryDirectory(prefix="recxla-cluster-")
            self.mode = self._setup_network()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _setup_network(self) -> str:
        if self.requested_mode == "loopback":
            return "loopback"
        try:
            self.topology.create()
            return "netns"
        except (netns.NetnsUnavailable, OSError, subprocess.SubprocessError) as e:
            if self.requested_mode == "netns":
                raise
            self.fallback_reason = str(e)
            print(
                f"bench.cluster: cannot emulate {self.nodes} node(s) with network namespaces "
                f"({e}); falling back to plain loopback: all {self.world_size} ranks on "
                f"127.0.0.1, no link shaping, so cross-node figures are NOT emulated.",
                file=sys.stderr,
                flush=True,
            )
            return "loopback"

    def close(self) -> None:
        """End every rank still running and remove the topology (idempotent)."""
        self._kill_all()
        self.topology.destroy()
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None
        self._restore_signal_handlers()
        atexit.unregister(self.close)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread

        def handler(signum, frame):
            raise _Terminated(f"bench.cluster: received signal {signum}")

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    def _kill_all(self) -> None:
        # Each rank leads its own process group (start_new_session): end the group, so that
        # anything the rank started goes too.
        procs = [p for _, p in self._procs]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.02)
        for p in procs:
            try:
                p.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        self._procs = []

    # -- jobs -------------------------------------------------------------------------------
    def rank_env(self, rank: int, master_port: int) -> Dict[str, str]:
        """The environment rank `rank` runs with."""
        node, local = divmod(rank, self.ranks_per_node)
        netns_mode = self.mode == "netns"
        env = dict(os.environ)
        env.update(
            MASTER_ADDR=netns.node_address(0) if netns_mode else "127.0.0.1",
            MASTER_PORT=str(master_port),
            RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(local),
            LOCAL_WORLD_SIZE=str(self.ranks_per_node),
            GROUP_RANK=str(node),
            GLOO_SOCKET_IFNAME=netns.IFACE if netns_mode else "lo",
            RECXLA_CLUSTER_MODE=self.mode or "loopback",
            RECXLA_CLUSTER_NODES=str(self.nodes),
            OMP_NUM_THREADS=str(self.threads_per_rank),
            PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p),
        )
        return env

    def run(
        self,
        target: str,
        kwargs: Optional[Dict[str, Any]] = None,
        timeout: float = 300.0,
        init_process_group: bool = True,
    ) -> List[Any]:
        """Run `target` ("module:function") on every rank and return the ranks' results.

        Args:
            target: a function importable from the repository root; it is called with
                `**kwargs` after the gloo process group is up (when `init_process_group`).
            kwargs: JSON-serializable keyword arguments, the same for every rank.
            timeout: seconds for the whole job, process start-up included.
        Returns:
            list of world_size JSON values, index = rank.
        Raises:
            ClusterJobError when a rank fails (with its stderr), ClusterTimeout past `timeout`.
        """
        try:
            paths = self._spawn(target, kwargs, timeout, init_process_group,
                                range(self.world_size))[1]
            self._wait(paths, time.monotonic() + timeout, timeout)
            return self._collect(paths)
        finally:
            self._kill_all()

    def start_peers(
        self, target: str, kwargs: Optional[Dict[str, Any]] = None, timeout: float = 300.0
    ) -> "PeerGroup":
        """Start ranks 1..W-1 running `target`; the calling process is to be rank 0.

        For benchmarks timed inside this process (pytest-benchmark): call
        `peers.init_process_group()` here, drive the peers through collectives, then
        `peers.finish()` for their results. Loopback mode only, since this process is not inside
        a namespace. The peers are ended when the cluster closes, whatever happens.
        """
        if self.mode != "loopback":
            raise ValueError(
                f"EmulatedCluster.start_peers: needs mode 'loopback' (this process is rank 0 "
                f"and runs on the host's loopback), got mode {self.mode!r}")
        port, paths = self._spawn(target, kwargs, timeout, True, range(1, self.world_size))
        return PeerGroup(self, port, paths, time.monotonic() + timeout, timeout)

    def _spawn(self, target, kwargs, timeout, init_process_group, ranks):
        if self.mode is None:
            raise RuntimeError("EmulatedCluster.run: use the cluster inside a `with` block")
        job_dir = tempfile.mkdtemp(dir=self._workdir.name)
        job_path = os.path.join(job_dir, "job.json")
        with open(job_path, "w") as f:
            json.dump(
                {"target": target, "kwargs": kwargs or {}, "timeout_s": timeout,
                 "init_process_group": init_process_group},
                f,
            )
        if self.mode == "netns":
            # Fresh namespaces hold no other listener; a new port per job avoids TIME_WAIT.
            port, self._next_port = self._next_port, self._next_port + 1
        else:
            port = free_port()
        paths = {}
        for rank in ranks:
            env = self.rank_env(rank, port)
            result = os.path.join(job_dir, f"rank{rank}.json")
            log = os.path.join(job_dir, f"rank{rank}.log")
            env["RECXLA_CLUSTER_RESULT"] = result
            paths[rank] = (result, log)
            argv = [sys.executable, "-m", "bench.cluster.rank", job_path, str(rank)]
            if self.mode == "netns":
                argv = self.topology.exec_prefix(rank // self.ranks_per_node) + argv
            with open(log, "w") as log_f, _signals_held():
                self._procs.append((rank, subprocess.Popen(
                    argv, env=env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log_f,
                    stderr=subprocess.STDOUT, start_new_session=True)))
                self.started_pids.append(self._procs[-1][1].pid)
        return port, paths

    @staticmethod
    def _collect(paths) -> List[Any]:
        results = []
        for rank, (result, log) in sorted(paths.items()):
            if not os.path.exists(result):
                raise ClusterJobError(
                    f"bench.cluster: rank {rank} exited without a result; its output:\n"
                    f"{_tail(log)}")
            with open(result) as f:
                results.append(json.load(f))
        return results

    def _wait(self, paths, deadline: float, timeout: float) -> None:
        while True:
            codes = {r: p.poll() for r, p in self._procs}
            failed = [r for r, c in codes.items() if c not in (None, 0)]
            if failed:
                r = failed[0]
                raise ClusterJobError(
                    f"bench.cluster: rank {r} of {self.world_size} failed (exit {codes[r]}, mode "
                    f"{self.mode}); its output:\n{_tail(paths[r][1])}")
            if all(c == 0 for c in codes.values()):
                return
            if time.monotonic() > deadline:
                running = [r for r, c in codes.items() if c is None]
                raise ClusterTimeout(
                    f"bench.cluster: job ran past its timeout of {timeout:g} s; ranks {running} "
                    f"were still running and were ended. Output of rank {running[0]}:\n"
                    f"{_tail(paths[running[0]][1])}")
            time.sleep(0.02)


_HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@contextlib.contextmanager
def _signals_held():
    """Holds Ctrl-C and SIGTERM/SIGHUP back (main thread only) until the block ends, so that a
    rank is recorded as soon as it is started: an interrupt inside Popen would otherwise leave
    a running rank that close() does not know of. A signal that arrives meanwhile is delivered
    when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


class PeerGroup:
    """Ranks 1..W-1 of a job whose rank 0 is the calling process (EmulatedCluster.start_peers)."""

    def __init__(self, cluster: EmulatedCluster, port: int, paths, deadline: float, timeout):
        self.cluster, self.port, self._paths = cluster, port, paths
        self._deadline, self._timeout = deadline, timeout

    def init_process_group(self):
        """Join the peers' gloo group as rank 0 (on loopback); returns torch.distributed."""
        import torch.distributed as dist

        old = os.environ.get("GLOO_SOCKET_IFNAME")
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the interface the peers bind, not the host's
        try:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{self.port}", rank=0,
                world_size=self.cluster.world_size,
                timeout=timedelta(seconds=self._timeout))
        finally:
            if old is None:
                os.environ.pop("GLOO_SOCKET_IFNAME")
            else:
                os.environ["GLOO_SOCKET_IFNAME"] = old
        return dist

    def finish(self) -> List[Any]:
        """Wait for the peers to exit; their results, index = rank - 1 (errors as in run())."""
        try:
            self.cluster._wait(self._paths, self._deadline, self._timeout)
            return self.cluster._collect(self._paths)
        finally:
            self.cluster._kill_all()


def run_job(
    target: str,
    kwargs: Optional[Dict[str, Any]] = None,
    nodes: int = 1,
    ranks_per_node: int = 2,
    rate: Optional[str] = "1gbit",
    mode: str = "auto",
    timeout: float = 300.0,
) -> List[Any]:
    """One job on a cluster built for it and removed afterwards; see EmulatedCluster.run."""
    with EmulatedCluster(nodes, ranks_per_node, rate=rate, mode=mode) as cluster:
        return cluster.run(target, kwargs, timeout=timeout)
