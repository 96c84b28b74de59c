"""Joining the job: this rank's place (from torchrun's variables), the store, the process group.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and hosts
the store itself (TORCHELASTIC_USE_AGENT_STORE=True), so the store outlives any worker. Started
any other way with those variables (the emulated-cluster benchmark does so), rank 0 hosts it,
for as long as its process lives. Without them, `python -m recxla.train` is a job of one rank on
this machine. A process may train more than once (every rank the same runs in turn): each run
keys the store under a prefix of its own.

The process group is gloo on CPU and NCCL on GPU, with the run's --timeout to join (then
COLLECTIVE_TIMEOUT_S: the watchdog ends hangs), built on a client of that store. The watchdog
gets a client of its own, so that its heartbeats never queue behind a call of the training
loop.

A store recxla hosts listens on MASTER_ADDR alone, not on every interface as torch's TCPStore
server does (it binds the wildcard address): the store is unauthenticated, and with
MASTER_ADDR=127.0.0.1 nothing off this machine should reach it. `listening_socket` binds the
address and torch's server takes the socket (TCPStore's `master_listen_fd`). A host name that
resolves to a loopback address here (Debian's `127.0.1.1 <hostname>` line) while other machines
reach it by another address is the one case where the store listens on every interface, as
before: binding loopback would refuse the other nodes' ranks. torchrun's own store (the agent's)
is torchrun's: it binds as torch does.
"""

import datetime
import ipaddress
import itertools
import os
import socket
import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankPlace:
    """This process's place in the job (torchrun's variables)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    agent_store: bool
    restart: int

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def place_from_env(env=None) -> RankPlace:
    """RankPlace from torchrun's environment variables; a one-rank job when they are absent.
    Raises ValueError for inconsistent values (before anything connects)."""
    env = os.environ if env is None else env
    if "RANK" not in env:
        return RankPlace(0, 1, 0, 1, "127.0.0.1", _free_port(), False, 0)
    try:
        place = RankPlace(
            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            restart=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
        )
    except (KeyError, ValueError) as e:
        raise ValueError(f"recxla-train: incomplete or malformed launcher variables (RANK, "
                         f"WORLD_SIZE, MASTER_ADDR, MASTER_PORT): {e}") from None
    if not 0 <= place.rank < place.world_size or place.world_size % place.local_world_size:
        raise ValueError(f"recxla-train: RANK={place.rank}, WORLD_SIZE={place.world_size}, "
                         f"LOCAL_WORLD_SIZE={place.local_world_size} do not fit together")
    return place


def bind_address(master_addr: str) -> Optional[Tuple[int, str]]:
    """(address family, address) a store host for `master_addr` listens on: the address itself
    (an IP address, `localhost`, or a host name as it resolves here); None (every interface)
    for a host name other than localhost that resolves to a loopback address here, which other
    machines reach by another address."""
    # The first address, the one this machine's clients of `master_addr` try first.
    family, _, _, _, sockaddr = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)[0]
    try:
        ipaddress.ip_address(master_addr)
        literal = True
    except ValueError:
        literal = False
    if not literal and master_addr != "localhost" and \
            ipaddress.ip_address(sockaddr[0].split("%")[0]).is_loopback:
        return None
    return family, sockaddr[0]


def listening_socket(master_addr: str, port: int) -> Optional[socket.socket]:
    """A TCP socket listening on `master_addr`'s address (`bind_address`), port `port` (0: a
    free one), for a TCPStore server to take over; None where `bind_address` says every
    interface (torch's server then binds as it does). OSError when the address is not one of
    this machine's or the port is taken."""
    where = bind_address(master_addr)
    if where is None:
        return None
    family, address = where
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As torch's own server: a port a previous run left in TIME_WAIT can be bound again.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def _store(place: RankPlace, timeout: datetime.timedelta, host: bool) -> dist.TCPStore:
    """A client of the job's store, or (host) the store's server, listening on MASTER_ADDR."""
    listen_fd = None
    if host:
        try:
            sock = listening_socket(place.master_addr, place.master_port)
        except OSError as e:
            raise RuntimeError(
                f"recxla-train: rank {place.rank} hosts the rendezvous store and cannot listen "
                f"on MASTER_ADDR={place.master_addr} MASTER_PORT={place.master_port}: {e} "
                "(MASTER_ADDR must be an address of this machine, the port a free one)") from None
        if sock is not None:
            listen_fd = sock.detach()  # the store's server owns the socket from here on
    return dist.TCPStore(
        place.master_addr, place.master_port, place.world_size, is_master=host,
        timeout=timeout, wait_for_workers=False, master_listen_fd=listen_fd,
    )


@dataclass
class Connection:
    """The job as this rank sees it: place, device, process group's store and the watchdog's."""

    place: RankPlace
    device: torch.device
    backend: str
    store: dist.Store
    watchdog_store: dist.Store
    _host: Optional[dist.TCPStore] = None

    def close(self, timeout_s: float = 30.0) -> None:
        """Destroy the process group and count this rank out of the job. The rank that hosts
        the store (rank 0 of a job started without torchrun's agent store) waits, up to
        `timeout_s`, until every rank has counted itself out: a rank still talking to the store
        (its watchdog's last heartbeat) would otherwise take the host's exit for a failure."""
        if dist.is_initialized():
            dist.destroy_process_group()
        try:
            left = self.watchdog_store.add("left", 1)
            deadline = time.monotonic() + timeout_s
            while self._host is not None and left < self.place.world_size and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
                left = self.watchdog_store.add("left", 0)
        except RuntimeError:  # the store is gone (its host left): nothing to wait for
            pass


# How long a collective may wait once the process group is up: torch's default for gloo. The
# watchdog ends a hang within --timeout; this only bounds a wait for a peer whose loader is slow
# but alive, which the watchdog lets run.
COLLECTIVE_TIMEOUT_S = 1800.0


# A process may train more than once (a notebook, a sweep calling recxla.train.cli.main in
# turn), every rank the same runs in the same order. Each run keys its process group and its
# watchdog under a prefix of its own: the store may be the same (torchrun's agent store, or the
# one rank 0 hosts) and still hold the last run's keys. The store rank 0 hosts lives as long as
# the process: the next run's clients may reach MASTER_PORT before a new server could listen.
_runs_in_process = itertools.count()
_hosted_stores: Dict[Tuple[str, int], dist.TCPStore] = {}


def connect(place: RankPlace, device_type: str, timeout_s: float) -> Connection:
    """Create the store clients and the process group of this rank."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        torch.cuda.set_device(place.local_rank)
        device, backend = torch.device("cuda", place.local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    hosting = place.rank == 0 and not place.agent_store
    if hosting:
        where = (place.master_addr, place.master_port)
        if where not in _hosted_stores:
            _hosted_stores[where] = _store(place, timeout, host=True)
        store = _hosted_stores[where]
    else:
        store = _store(place, timeout, host=False)
    watchdog_store = _store(place, timeout, host=False)
    prefix = f"recxla/train/run{place.restart}/{next(_runs_in_process)}/"
    dist.init_process_group(
        backend, store=dist.PrefixStore(prefix + "pg", store), rank=place.rank,
        world_size=place.world_size, timeout=timeout,
    )
    # --timeout bounds joining the job. Past that, a collective whose peer waits on its own
    # live loader worker (a transform slower than --timeout on one batch) is no hang, and the
    # watchdog, which tells the two apart, ends real hangs within --timeout: the group's own
    # timeout becomes the longer COLLECTIVE_TIMEOUT_S.
    if timeout_s < COLLECTIVE_TIMEOUT_S:
        dist.set_timeout(datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return Connection(place, device, backend, store, dist.PrefixStore(prefix, watchdog_store),
                      store if hosting else None)
