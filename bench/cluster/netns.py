"""An emulated cluster network on one Linux machine: network namespaces, veth pairs, tbf shaping.

Recipe (needs root, i.e. CAP_NET_ADMIN, and iproute2's `ip` and `tc`):

```
            namespace <p>-sw: bridge br0 (a non-blocking switch)
              |  port n0 (tbf: switch -> node 0)      |  port n1 (tbf: switch -> node 1)  ...
            veth pair                               veth pair
              |  rx0 198.18.0.1/24 (tbf: node 0 ->)   |  rx0 198.18.0.2/24 (tbf: node 1 ->)
            namespace <p>-n0                        namespace <p>-n1
            ranks 0..R-1 (`ip netns exec`)          ranks R..2R-1
```

- Every emulated node is a namespace holding one interface, `rx0`, addressed in 198.18.0.0/15 (the
  range reserved for network benchmarks, RFC 2544), so nothing can leak to a real network.
- Nodes are joined through one bridge namespace, one veth pair per node. Any number of nodes is
  routed this way (a bare veth pair only joins two), and every node has its own full-duplex link:
  tbf shapes only a device's egress, so each end of each pair gets its own `tbf rate RATE`.
  Traffic between two nodes crosses the sender's uplink and the receiver's downlink; the bridge
  itself is not a bottleneck.
- Ranks of one node all bind gloo to `rx0` (GLOO_SOCKET_IFNAME=rx0), an address the other nodes
  can reach. Linux routes traffic to a namespace's own addresses over its loopback, so ranks of
  one node talk at loopback speed and only cross-node traffic meets the shaped links.
- IPv6 link-local addresses are switched off on `rx0` (addrgenmode none): gloo binds the first
  address of the interface it is given and a link-local one cannot be reached without a scope.
- Namespaces are named `rxc-<pid>-<k>-...` after the process that made them. Teardown deletes
  them (which destroys the veths), after ending any process still inside; a namespace left by a
  process that was killed outright (SIGKILL) is swept by the next topology this code builds.

Limits, to keep in mind when reading figures measured with it:
- All ranks share the machine's cores and memory bandwidth: compute does not scale with the
  emulated node count, and a rank's quantize/dequantize competes with other ranks for the CPU.
- tbf shapes throughput only. It adds no propagation delay (netem is not available here), so a
  small message costs loopback latency (tens of microseconds), not a real network's.
- tbf with a `burst` of 256 KiB lets short transfers run faster than RATE for their first
  burst bytes; it matters only for messages of a few hundred KiB or less.
- Measured here: one TCP stream through a 1 Gbit/s link reaches about 0.96 Gbit/s, and two
  streams, one each way, reach 0.95 Gbit/s each at once (the links are full duplex). gloo does
  not get that: a gloo pair that sends and receives at the same time moves about half the rate
  each way (16 MiB one way: 140 ms; 8 MiB each way at once, a 2-rank all-to-all of 16 MiB per
  rank: 138 ms), while one plain socket carrying both directions gets 0.9 Gbit/s each way. So it
  is gloo's TCP transport, not the emulated link: an all-to-all across nodes here costs about
  twice bytes / rate.
- No packet loss, no congestion from other tenants, no NIC offloads or RDMA: an upper bound
  on what a clean switched Ethernet of that rate gives a TCP collective library like gloo.

`probe()` says whether this machine can build it; `Topology.create()` builds it (raising
`NetnsUnavailable` with the reason when it cannot) and `Topology.destroy()` removes it.

Bytes on the links: every node's traffic to other nodes crosses its `rx0`, so its counters
(tx: node -> switch, rx: switch -> node) are the bytes that met the shaped link, measured rather
than computed: payload plus TCP/IP headers (one set per GSO packet on veth) plus ACKs. A rank
reads its own node's with `interface_bytes()` (`ip netns exec` shows it its namespace's sysfs);
the launcher reads every node's with `Topology.link_counters()`.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

# Addresses: node i is 198.18.0.(i + 1) on a /24 inside 198.18.0.0/15.
SUBNET_PREFIX = "198.18.0."
SUBNET_BITS = 24
MAX_NODES = 250
IFACE = "rx0"
NAME_PREFIX = "rxc"
_NAME_RE = re.compile(rf"^{NAME_PREFIX}-(\d+)-\d+-(?:sw|n\d+)$")
_counter = 0


class NetnsUnavailable(RuntimeError):
    """Network namespaces or shaping cannot be set up here; the message says why."""


def node_address(node: int) -> str:
    """The IPv4 address of emulated node `node` (0-based)."""
    return f"{SUBNET_PREFIX}{node + 1}"


def _run(args: List[str], timeout: float = 10.0) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)


def _check(args: List[str]) -> None:
    proc = _run(args)
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip()
        raise NetnsUnavailable(f"`{' '.join(args)}` failed (exit {proc.returncode}): {msg}")


def probe(shaped: bool = True) -> Optional[str]:
    """None when namespaces (and tc shaping, if `shaped`) can be tried here; else the reason."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not running as root (network namespaces need CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not on PATH"
    if shaped and shutil.which("tc") is None:
        return "iproute2's `tc` is not on PATH (needed to shape the links)"
    proc = _run(["ip", "netns", "list"])
    if proc.returncode != 0:
        return f"`ip netns list` failed: {(proc.stderr or proc.stdout).strip()}"
    return None


def list_namespaces() -> List[str]:
    """Names of all network namespaces that `ip netns` knows."""
    proc = _run(["ip", "netns", "list"])
    if proc.returncode != 0:
        return []
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


COUNTERS = ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets")


def interface_bytes(iface: str = IFACE) -> Dict[str, int]:
    """The counters of `iface` in the calling process's network namespace: {"rx_bytes",
    "tx_bytes", "rx_packets", "tx_packets"} since the interface was created. Inside a node of a
    Topology, `iface` = "rx0" is the node's link; on the host, "lo" is the loopback (where every
    packet is counted once sent and once received)."""
    out = {}
    for name in COUNTERS:
        with open(f"/sys/class/net/{iface}/statistics/{name}") as f:
            out[name] = int(f.read())
    return out


def pid_alive(pid: int) -> bool:
    """Whether `pid` still runs. A zombie (ended, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The state follows the command name, which is in parentheses and may hold any
            # character: read it after the last ")".
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False  # reaped since
    except (OSError, IndexError):
        return True


def sweep_stale() -> List[str]:
    """Delete namespaces that this code made for a process that no longer exists."""
    removed = []
    for name in list_namespaces():
        m = _NAME_RE.match(name)
        if m and not pid_alive(int(m.group(1))):
            if _run(["ip", "netns", "del", name]).returncode == 0:
                removed.append(name)
    return removed


def _end_processes_in(ns: str) -> None:
    """End the processes still inside `ns` (the ranks this harness launched there): a namespace
    whose name is deleted lives on, with its veths, as long as a process holds it."""
    pids = [int(p) for p in _run(["ip", "netns", "pids", ns]).stdout.split() if p.isdigit()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(pid_alive(p) for p in alive):
            time.sleep(0.05)
        pids = [p for p in alive if pid_alive(p)]


@dataclass
class Topology:
    """`nodes` namespaces joined by a bridge namespace; links shaped to `rate` when it is set.

    rate, burst, latency: tbf's parameters (tc syntax: "1gbit", "256kb", "100ms"). `latency` bounds
    how long a packet may queue in tbf; it is generous so that bursts of a collective queue
    instead of being dropped (drops would measure TCP's recovery, not the link).
    """

    nodes: int
    rate: Optional[str] = "1gbit"
    burst: str = "256kb"
    latency: str = "100ms"
    prefix: str = ""
    created: List[str] = field(default_factory=list)

    def __post_init__(self):
        global _counter
        if not isinstance(self.nodes, int) or not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(
                f"Topology: nodes must be an int in [1, {MAX_NODES}], got {self.nodes!r}")
        if not self.prefix:
            _counter += 1
            self.prefix = f"{NAME_PREFIX}-{os.getpid()}-{_counter}"

    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}-sw"

    def node_ns(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def namespaces(self) -> List[str]:
        return [self.switch_ns] + [self.node_ns(i) for i in range(self.nodes)]

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate is not None:
            _check(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                    "burst", self.burst, "latency", self.latency])

    def create(self) -> "Topology":
        """Build the namespaces, veths, bridge and shaping. On any failure, removes what it
        built and raises NetnsUnavailable with the failing command and its error."""
        reason = probe(shaped=self.rate is not None)
        if reason is not None:
            raise NetnsUnavailable(reason)
        sweep_stale()
        try:
            for ns in self.namespaces():
                _check(["ip", "netns", "add", ns])
                self.created.append(ns)
                _check(["ip", "-n", ns, "link", "set", "lo", "up"])
            sw = self.switch_ns
            _check(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
            _check(["ip", "-n", sw, "link", "set", "br0", "up"])
            for i in range(self.nodes):
                ns, port = self.node_ns(i), f"n{i}"
                # Created straight inside the two namespaces: no name is ever taken on the host.
                _check(["ip", "link", "add", IFACE, "netns", ns, "type", "veth",
                        "peer", "name", port, "netns", sw])
                _check(["ip", "-n", sw, "link", "set", port, "master", "br0"])
                _check(["ip", "-n", sw, "link", "set", port, "up"])
                _check(["ip", "-n", ns, "link", "set", IFACE, "addrgenmode", "none"])
                _check(["ip", "-n", ns, "addr", "add", f"{node_address(i)}/{SUBNET_BITS}",
                        "dev", IFACE])
                _check(["ip", "-n", ns, "link", "set", IFACE, "up"])
                self._shape(ns, IFACE)  # node -> switch
                self._shape(sw, port)  # switch -> node
        except BaseException:
            self.destroy()
            raise
        return self

    def link_counters(self) -> List[Dict[str, int]]:
        """Per node, the counters of its link (`rx0` in its namespace, read from the host with
        `ip -n`): {"rx_bytes", "tx_bytes", "rx_packets", "tx_packets"}, tx = node -> switch."""
        out = []
        for i in range(self.nodes):
            proc = _run(["ip", "-n", self.node_ns(i), "-s", "-j", "link", "show", "dev", IFACE])
            if proc.returncode != 0:
                raise NetnsUnavailable(
                    f"reading node {i}'s link counters failed: {(proc.stderr or proc.stdout).strip()}")
            stats = json.loads(proc.stdout)[0]["stats64"]
            out.append({"rx_bytes": stats["rx"]["bytes"], "tx_bytes": stats["tx"]["bytes"],
                        "rx_packets": stats["rx"]["packets"], "tx_packets": stats["tx"]["packets"]})
        return out

    def exec_prefix(self, node: int) -> List[str]:
        """The argv prefix that runs a command inside node `node`'s namespace."""
        return ["ip", "netns", "exec", self.node_ns(node)]

    def destroy(self) -> None:
        """Remove every namespace this topology made (idempotent). Deleting a namespace destroys
        the veth ends inside it, and with them their peers."""
        for ns in reversed(self.created):
            _end_processes_in(ns)
            _run(["ip", "netns", "del", ns])
        self.created.clear()

    def leftovers(self) -> List[str]:
        """Namespaces of this topology that still exist (empty after destroy())."""
        mine = set(self.namespaces())
        return [ns for ns in list_namespaces() if ns in mine]
