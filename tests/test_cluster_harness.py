"""The emulated-cluster harness (bench/cluster): jobs run and report, errors surface, and nothing
is left behind (ranks, namespaces, veths), whether the job succeeds, fails, times out, or the
launcher itself is interrupted."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

# bench/ is a folder of the repository, not of the installed package: make it importable however
# pytest is started (`pytest` does not put the working directory on sys.path).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.cluster import (  # noqa: E402
    ClusterBusy,
    ClusterJobError,
    ClusterTimeout,
    EmulatedCluster,
    NetnsUnavailable,
    benchmark_lock,
    netns,
    probe,
)
from bench.cluster.launch import REPO_ROOT  # noqa: E402

pytestmark = pytest.mark.distributed

NETNS_REASON = probe(shaped=True)
needs_netns = pytest.mark.skipif(
    NETNS_REASON is not None, reason=f"network namespaces unavailable: {NETNS_REASON}"
)


def _assert_clean(cluster: EmulatedCluster, pids=()):
    assert cluster.topology.leftovers() == []
    assert not [ns for ns in netns.list_namespaces() if ns.startswith(cluster.topology.prefix)]
    assert not [p for p in pids if netns.pid_alive(p)]


def _check_hello(results, world, payload):
    assert [r["rank"] for r in results] == list(range(world))
    expected = sum(r + payload for r in range(world))
    assert all(r["allreduce"] == expected for r in results)
    assert all(r["world_size"] == world for r in results)


def test_loopback_job_returns_each_ranks_result():
    payload = random.randrange(1, 1000)
    with EmulatedCluster(nodes=2, ranks_per_node=1, mode="loopback") as cluster:
        assert cluster.mode == "loopback" and cluster.fallback_reason is None
        results = cluster.run("bench.cluster.jobs:hello", {"payload": payload}, timeout=60)
    _check_hello(results, 2, payload)
    # Placement is node-major even without namespaces: rank 1 is node 1's first rank.
    assert [(r["node"], r["local_rank"]) for r in results] == [(0, 0), (1, 0)]
    assert all(r["iface"] == "lo" and r["mode"] == "loopback" for r in results)
    _assert_clean(cluster, [r["pid"] for r in results])


@needs_netns
def test_netns_ranks_run_in_their_node_and_links_are_shaped():
    payload = random.randrange(1, 1000)
    # 40 Mbit/s with a small burst: 512 KiB across the link takes >= 105 ms; over loopback it
    # would take about a millisecond, so the timing tells that traffic crossed the shaped link.
    with EmulatedCluster(nodes=2, ranks_per_node=1, rate="40mbit", burst="32kb",
                         mode="netns") as cluster:
        assert cluster.mode == "netns"
        assert sorted(cluster.topology.leftovers()) == sorted(cluster.topology.namespaces())
        results = cluster.run("bench.cluster.jobs:hello",
                              {"payload": payload, "a2a_bytes": 512 << 10}, timeout=60)
    _check_hello(results, 2, payload)
    assert [r["node"] for r in results] == [0, 1]
    # Inside a namespace a rank sees only its loopback and its link, not the host's interfaces.
    assert all(r["interfaces"] == ["lo", netns.IFACE] and r["iface"] == netns.IFACE
               for r in results)
    theory = (512 << 10) * 8 / 40e6
    assert results[0]["a2a_seconds"] >= 0.5 * theory, results
    _assert_clean(cluster, [r["pid"] for r in results])


def test_fallback_to_loopback_says_why(monkeypatch, capfd):
    real_which = netns.shutil.which
    monkeypatch.setattr(netns.shutil, "which", lambda n: None if n == "tc" else real_which(n))
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)  # reach the tc check even as non-root
    with EmulatedCluster(nodes=2, ranks_per_node=1, mode="auto") as cluster:
        assert cluster.mode == "loopback"
        assert "tc" in cluster.fallback_reason
        results = cluster.run("bench.cluster.jobs:sleep", {"seconds": 0}, init_process_group=False)
    err = capfd.readouterr().err
    assert "falling back to plain loopback" in err and "`tc` is not on PATH" in err
    assert len(results) == 2
    with pytest.raises(NetnsUnavailable, match="`tc` is not on PATH"):
        with EmulatedCluster(nodes=2, ranks_per_node=1, mode="netns"):
            pass


@pytest.mark.parametrize("mode", ["loopback", pytest.param("netns", marks=needs_netns)])
def test_failing_rank_raises_with_its_traceback_and_ends_the_others(mode):
    with EmulatedCluster(nodes=2, ranks_per_node=2, mode=mode) as cluster:
        t0 = time.monotonic()
        with pytest.raises(ClusterJobError, match=r"rank 1 of 4 failed \(exit 1"):
            cluster.run("bench.cluster.jobs:fail", {"message": "boom-42", "others_sleep": 60},
                        timeout=60, init_process_group=False)
        # Fails fast: the ranks still sleeping were ended, not waited for.
        assert time.monotonic() - t0 < 30
    assert len(cluster.started_pids) == 4
    _assert_clean(cluster, cluster.started_pids)


def test_failing_rank_message_holds_its_output():
    with EmulatedCluster(nodes=1, ranks_per_node=2, mode="loopback") as cluster:
        with pytest.raises(ClusterJobError, match="RuntimeError: boom-42"):
            cluster.run("bench.cluster.jobs:fail", {"message": "boom-42"}, timeout=60,
                        init_process_group=False)


def test_timeout_ends_every_rank():
    with EmulatedCluster(nodes=1, ranks_per_node=2, mode="loopback") as cluster:
        t0 = time.monotonic()
        with pytest.raises(ClusterTimeout, match=r"past its timeout of 1 s; ranks \[0, 1\]"):
            cluster.run("bench.cluster.jobs:sleep", {"seconds": 60}, timeout=1,
                        init_process_group=False)
        assert time.monotonic() - t0 < 15
    assert len(cluster.started_pids) == 2
    _assert_clean(cluster, cluster.started_pids)


_INTERRUPTED = textwrap.dedent("""
    import faulthandler, signal, sys
    faulthandler.register(signal.SIGUSR1)
    from bench.cluster import EmulatedCluster
    with EmulatedCluster(nodes=2, ranks_per_node=1, mode="netns") as cluster:
        print(cluster.topology.prefix, flush=True)
        cluster.run("bench.cluster.jobs:sleep", {"seconds": 60}, timeout=60,
                    init_process_group=False)
""")


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupted_launcher_removes_namespaces_and_ranks(sig):
    # The launcher's Ctrl-C as a terminal gives it: a suite run in the background of a
    # non-interactive shell starts with SIGINT ignored, and a child inherits that.
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        prefix = proc.stdout.readline().strip()
        assert prefix.startswith(netns.NAME_PREFIX), proc.stderr.read()
        # Wait until both ranks are running inside their namespaces.
        deadline = time.monotonic() + 20
        pids = []
        while time.monotonic() < deadline and len(pids) < 2:
            pids = [int(p) for i in range(2) for p in subprocess.run(
                ["ip", "netns", "pids", f"{prefix}-n{i}"], capture_output=True, text=True
            ).stdout.split()]
            time.sleep(0.05)
        assert len(pids) == 2
        proc.send_signal(sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # faulthandler: where the launcher is stuck
            time.sleep(1)
            proc.kill()
            pytest.fail(f"the launcher did not end within 20 s of signal {sig}; its stacks:\n"
                        f"{proc.communicate()[1]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert not [ns for ns in netns.list_namespaces() if ns.startswith(prefix)]
    assert not [p for p in pids if netns.pid_alive(p)]


def test_stale_namespaces_of_dead_processes_are_swept():
    if NETNS_REASON is not None:
        pytest.skip(f"network namespaces unavailable: {NETNS_REASON}")
    # A pid that is not running: the largest possible pid is never handed out in practice.
    dead = int(open("/proc/sys/kernel/pid_max").read()) - 1
    assert not netns.pid_alive(dead)
    name = f"{netns.NAME_PREFIX}-{dead}-1-sw"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netns.sweep_stale()
        assert name not in netns.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"nodes": 0}, r"nodes must be an int >= 1, got 0"),
        ({"ranks_per_node": 1.5}, r"ranks_per_node must be an int >= 1, got 1.5"),
        ({"nodes": netns.MAX_NODES + 1}, rf"nodes must be at most {netns.MAX_NODES}"),
        ({"mode": "tcp"}, r"mode must be one of \('auto', 'netns', 'loopback'\), got 'tcp'"),
    ],
)
def test_bad_arguments_name_the_limit(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EmulatedCluster(**kwargs)


def test_run_outside_with_block_and_bad_target():
    cluster = EmulatedCluster(mode="loopback")
    with pytest.raises(RuntimeError, match="inside a `with` block"):
        cluster.run("bench.cluster.jobs:hello")
    with cluster:
        with pytest.raises(ClusterJobError, match="target must be 'module:function'"):
            cluster.run("bench.cluster.jobs", timeout=30, init_process_group=False)


def test_a_second_benchmark_fails_at_once_naming_the_first(tmp_path):
    """Two cluster benchmarks at once would both measure wrong: the second one is refused while
    the first holds the lock, from another process too, and the lock goes with its holder."""
    lock = str(tmp_path / "bench.lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            sys.path.insert(0, {REPO_ROOT!r})
            from bench.cluster import benchmark_lock
            with benchmark_lock("first run", {lock!r}):
                print("held", flush=True)
                time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ClusterBusy, match=rf"second run: .*\(pid {holder.pid}: first run; "):
            with benchmark_lock("second run", lock):
                pytest.fail("the second run got the lock")
    finally:
        holder.kill()
        holder.wait()
    with benchmark_lock("third run", lock):  # the killed holder's lock is gone
        with pytest.raises(ClusterBusy, match=r"pid \d+: third run"):
            with benchmark_lock("nested run", lock):
                pass
