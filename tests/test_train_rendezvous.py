"""The store a trainer rank hosts listens on MASTER_ADDR alone (torch's server would listen on
every interface: an unauthenticated store reachable from the network with MASTER_ADDR=127.0.0.1),
and still serves the ranks' clients."""

import datetime
import socket

import pytest

from recxla.train import rendezvous
from recxla.train.rendezvous import RankPlace

LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp


def _listening_addresses(port: int):
    """The local addresses of the sockets in LISTEN on `port` in this network namespace, as
    ip strings (from /proc/net/tcp and tcp6)."""
    out = []
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] != LISTEN or int(hex_port, 16) != port:
                continue
            raw = bytes.fromhex(address)
            # The kernel prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out.append(socket.inet_ntop(family, raw))
    return out


@pytest.mark.skipif(not __import__("os").path.exists("/proc/net/tcp"),
                    reason="reads the listening sockets from Linux's /proc/net/tcp")
@pytest.mark.parametrize("addr", ["127.0.0.1", "localhost"])
def test_the_hosted_store_listens_on_master_addr_only(addr):
    port = rendezvous._free_port()
    place = RankPlace(0, 2, 0, 2, addr, port, False, 0)
    timeout = datetime.timedelta(seconds=10)
    host = rendezvous._store(place, timeout, host=True)
    listening = _listening_addresses(port)
    expected = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][4][0]
    assert listening == [expected], listening  # not 0.0.0.0 or ::
    client = rendezvous._store(place, timeout, host=False)
    client.set("k", "v")
    assert host.get("k") == b"v"


def test_bind_address_follows_master_addr(monkeypatch):
    bind_address = rendezvous.bind_address
    assert bind_address("127.0.0.1") == (socket.AF_INET, "127.0.0.1")
    assert bind_address("::1") == (socket.AF_INET6, "::1")
    real = socket.getaddrinfo

    def resolve(name, *args, **kwargs):
        fake = {"node0": "10.1.2.3", "debian-host": "127.0.1.1"}
        if name in fake:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (fake[name], 0))]
        return real(name, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert bind_address("node0") == (socket.AF_INET, "10.1.2.3")
    # A host name that resolves to loopback here while other machines reach it by its real
    # address (Debian's /etc/hosts): binding loopback would refuse them, so every interface.
    assert bind_address("debian-host") is None


def test_a_master_addr_of_another_machine_is_a_clear_error():
    # 192.0.2.1 (TEST-NET-1, RFC 5737) is an address of no machine here.
    place = RankPlace(0, 2, 0, 2, "192.0.2.1", rendezvous._free_port(), False, 0)
    with pytest.raises(RuntimeError, match="cannot listen on MASTER_ADDR=192.0.2.1"):
        rendezvous._store(place, datetime.timedelta(seconds=2), host=True)


def test_the_host_leaves_after_every_rank_has():
    """Connection.close: the rank that hosts the store returns only once every rank has counted
    itself out (a rank's last heartbeat must not find the store gone), or after its timeout;
    a client returns at once."""
    import threading
    import time

    import torch
    import torch.distributed as dist

    port = rendezvous._free_port()
    place = RankPlace(0, 2, 0, 2, "127.0.0.1", port, False, 0)
    timeout = datetime.timedelta(seconds=10)
    host = rendezvous._store(place, timeout, host=True)
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)

    def connection(store, hosted):
        return rendezvous.Connection(place, torch.device("cpu"), "gloo", store,
                                     dist.PrefixStore("run0/", store), hosted)

    first, second = connection(host, host), connection(client, None)
    closing = threading.Thread(target=first.close)
    closing.start()
    closing.join(0.5)
    assert closing.is_alive()  # the other rank has not left
    start = time.monotonic()
    second.close()
    assert time.monotonic() - start < 2  # a client does not wait
    closing.join(5)
    assert not closing.is_alive()
    # Alone (the other rank died without counting out): the host waits its timeout, no more.
    port = rendezvous._free_port()
    place = RankPlace(0, 2, 0, 2, "127.0.0.1", port, False, 0)
    lonely = rendezvous._store(place, timeout, host=True)
    start = time.monotonic()
    connection(lonely, lonely).close(timeout_s=0.3)
    assert 0.25 < time.monotonic() - start < 3


# A model small enough for a few steps in seconds on 2 shared cores (as tests/test_train_cli.py).
SMALL = ["--profile", "small", "--batch-size", "128", "--embedding-dim", "16",
         "--dense-arch", "32", "--over-arch", "32", "--eval-batches", "2", "--no-progress",
         "--steps", "3", "--warmup-steps", "1", "--timeout", "60"]


def _train_twice(rank: int, world: int, port: int, folder: str) -> None:
    """One rank of a job that trains twice in the same process (a notebook, a sweep)."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from recxla.train import cli

    for run in range(2):
        assert cli.main([*SMALL, "--metrics", f"{folder}/run{run}.json"]) == 0


def test_a_process_trains_twice(tmp_path):
    """Two runs in the same processes, MASTER_PORT unchanged: the second joins (its own keys
    in the store rank 0 hosted for the first) and trains as the first did, bit for bit."""
    import json
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    port = rendezvous._free_port()
    ranks = [context.Process(target=_train_twice, args=(r, 2, port, str(tmp_path)))
             for r in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(240)
    codes = [process.exitcode for process in ranks]
    for process in ranks:
        if process.is_alive():
            process.kill()
    assert codes == [0, 0], codes
    first, second = (json.loads((tmp_path / f"run{r}.json").read_text()) for r in range(2))
    assert first["final_loss"] == second["final_loss"] and first["auc"] == second["auc"]
