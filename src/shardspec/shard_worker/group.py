"""A worker's torch.distributed group: the rendezvous, the Gloo interface, the TP group of its stage.

Rank 0 hosts the rendezvous store on a socket it binds itself; every rank joins the default group
through it, each key and value sealed with the group's secret (SealedStore), and then makes its
stage's TP group (layers.parallel.TPGroup). On any failure a worker is left as if it had never
tried, so that the next init starts clean.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from shardspec.layers.parallel import TPGroup, cpu_shared_memory, use_symmetric_memory
from shardspec.protocol.errors import ErrorCode, ProtocolError
from shardspec.protocol.messages import InitRequest

log = logging.getLogger("shardspec.worker")
GLOO_IFNAME = os.environ.get("GLOO_SOCKET_IFNAME")  # the user's choice of Gloo's interface, if any
ABORT_POLL_S = 0.1  # while a rank waits for the rendezvous: how often it asks whether to give up
# the default group's SealedStore: torch holds it from C++ only, which does not keep its Python half
# (its methods) alive; the group's later groups and symmetric-memory buffers still use it
_group_store: list[dist.Store] = []


def join(body: InitRequest, device: torch.device, abort: Callable[[], str | None] = lambda: None,
         local: bool = False) -> tuple[TPGroup, str]:
    """This rank's TP group, after joining the process group when the stage has more than one rank
    (stages of one rank each share no collective, nor could ranks on one GPU: NCCL); and the backend.
    `abort` says why the rendezvous should stop waiting (the orchestrator left), or None; `local`:
    this worker listens on ipc:// (its orchestrator is on this host), where a file store may serve."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if body.tp_size > 1:
        if not body.dist_addr.startswith("tcp://") and not (local and body.dist_addr.startswith("file://")):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"dist_addr must be tcp://HOST:PORT (or, for a worker on "
                                f"ipc://, file://PATH), got {body.dist_addr!r}")
        log.info("joining %s group at %s as rank %d/%d", backend, body.dist_addr, body.rank, body.world_size)
        if backend == "gloo" and body.dist_addr.startswith("tcp://"):
            choose_gloo_interface(body.dist_addr)
        join_process_group(backend, body, device, abort)
    try:
        return tp_group(body, device), backend
    except BaseException:
        leave_process_group()  # back to idle as it was
        raise


def share_cores(host_ranks: int) -> None:
    """A CPU worker started without --threads takes its share of the cores it may run on, so the
    group's ranks on one host do not oversubscribe it (each torch would take them all)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // host_ranks)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    log.info("%d CPU threads: %d cores shared by the %d ranks of this group on this host (--threads to set)",
             threads, cores, host_ranks)


def join_process_group(backend: str, body: InitRequest, device: torch.device,
                       abort: Callable[[], str | None] = lambda: None) -> None:
    """torch.distributed's default group, through the rendezvous store at body.dist_addr (rank 0
    hosts it), sealed with the group's secret; on any failure this worker is left as if it had
    never tried."""
    timeout = timedelta(seconds=body.timeout_s)
    try:
        store = rendezvous_store(body.dist_addr, body.rank, body.world_size, timeout, abort)
        if body.dist_secret:
            store = SealedStore(body.dist_secret, store)
            _group_store[:] = [store]
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=body.rank,
                                world_size=body.world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    except ProtocolError:
        leave_process_group()
        raise
    except Exception as exc:  # a peer that never came
        leave_process_group()
        raise ProtocolError(ErrorCode.BAD_STATE, f"could not join the process group: {exc}") from None


def tp_group(body: InitRequest, device: torch.device) -> TPGroup:
    """This rank's group: its stage's ranks (every rank makes every stage's group, in order)."""
    tp = body.tp_size
    group = None
    if body.stages > 1 and tp > 1:
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(body.stages)]
        group = groups[body.stage]
    symmetric = use_symmetric_memory(device, tp, group)
    if symmetric:
        log.info("small all-reduces go through symmetric memory (--allreduce nccl: NCCL only)")
    shared = None
    if device.type == "cpu":
        try:
            shared = cpu_shared_memory(body.rank % tp, tp, group, body.timeout_s)
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
        if shared is not None:
            log.info("the TP group's collectives go through shared memory (--allreduce gloo: Gloo only)")
    return TPGroup(body.rank % tp, tp, group, symmetric=symmetric, shm=shared)


def leave_process_group() -> None:
    """Destroy the process group, if any, and reset torch.distributed's group counter: a failed init
    counts a group too, and a counter one ahead of the peers' names every key of the next group
    differently (the next init then waits for keys nobody writes)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    c10d._world.group_count = 0
    _group_store.clear()


def choose_gloo_interface(dist_addr: str) -> None:
    """Gloo binds to the address of this host's name, which is often a loopback address that the
    other hosts cannot reach: unless the user chose (GLOO_SOCKET_IFNAME), take the interface that
    routes to the rendezvous host."""
    if GLOO_IFNAME is not None:
        return
    name = interface_towards(dist_addr)
    if name is None:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
    else:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        log.info("Gloo uses interface %s (set GLOO_SOCKET_IFNAME to choose another)", name)


def interface_towards(address: str) -> str | None:
    """The name of the (IPv4) interface this host reaches tcp://HOST:PORT through; None for a
    loopback route or when it cannot be told (Linux ioctl)."""
    host, port = address[len("tcp://") :].rsplit(":", 1)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port)))  # sends nothing: only picks the route
            local = probe.getsockname()[0]
        if ipaddress.ip_address(local).is_loopback:
            return None
        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                except OSError:  # no IPv4 address on this interface
                    continue
            if socket.inet_ntoa(packed[20:24]) == local:
                return name
    except (OSError, ValueError):
        pass
    return None


def rendezvous_store(dist_addr: str, rank: int, world_size: int, timeout: timedelta,
                     abort: Callable[[], str | None] = lambda: None) -> dist.TCPStore:
    """The group's key-value store at tcp://HOST:PORT. Rank 0 serves it on a socket it binds itself,
    on HOST's address only (see _listen_address); a port in use fails at once, naming the port. At
    file://PATH (a group on one host): a file in a folder only this user may enter."""
    if dist_addr.startswith("file://"):
        return _file_store(Path(dist_addr[len("file://") :]), world_size, timeout)
    host, port = dist_addr[len("tcp://") :].rsplit(":", 1)
    host = host.strip("[]")
    if rank != 0:
        return _store_client(host, int(port), world_size, timeout, abort)
    listener = _rendezvous_listener(host, int(port))
    fd = listener.detach()  # the store owns the descriptor from here on
    return dist.TCPStore(host, int(port), world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=fd)


class SealedStore(dist.Store):
    """The group's view of the rendezvous store, which anyone who reaches its port may list, read
    and write (torch's TCPStore has no authentication): each key is stored under its HMAC with the
    group's secret, each value encrypted and authenticated with it. A stranger sees names and
    values that say nothing, cannot make a key's name, and a value it writes fails the group's read.
    Counters (`add`) stay plain: changing one can stall or fail the rendezvous, not feed it data.

    The sealing is SIV-like and deterministic (so compare_set still compares): the HMAC of the
    name and value is both the tag and the IV of an HMAC-SHA256 keystream."""

    TAG_BYTES = 32

    def __init__(self, secret: str, store: dist.Store):
        super().__init__()
        self.store = store
        self.name_key, self.tag_key, self.stream_key = (hmac.digest(secret.encode(), use, "sha256")
                                                         for use in (b"name", b"tag", b"stream"))
        super().set_timeout(store.timeout)  # what C++ callers read through the base class

    def _name(self, key: str) -> str:
        return hmac.new(self.name_key, key.encode(), hashlib.sha256).hexdigest()

    def _tag(self, name: str, value: bytes) -> bytes:
        return hmac.digest(self.tag_key, name.encode() + value, "sha256")  # (names: 64 hex digits)

    def _cipher(self, iv: bytes, data: bytes) -> bytes:
        """data XOR the keystream of iv: encrypts and decrypts."""
        blocks = -(-len(data) // 32)
        stream = b"".join(hmac.digest(self.stream_key, iv + i.to_bytes(8, "big"), "sha256") for i in range(blocks))
        return (int.from_bytes(data, "big") ^ int.from_bytes(stream[: len(data)], "big")).to_bytes(len(data), "big")

    def _seal(self, name: str, value: bytes) -> bytes:
        tag = self._tag(name, value)
        return tag + self._cipher(tag, value)

    def _open(self, name: str, sealed: bytes, key: str) -> bytes:
        tag = sealed[: self.TAG_BYTES]
        value = self._cipher(tag, sealed[self.TAG_BYTES :])
        if len(sealed) < self.TAG_BYTES or not hmac.compare_digest(tag, self._tag(name, value)):
            raise ValueError(f"the rendezvous store's value of {key!r} was written without the group's secret: "
                             "another process reaches the store's port")
        return value

    def set(self, key: str, value: bytes) -> None:
        name = self._name(key)
        self.store.set(name, self._seal(name, value))

    def get(self, key: str) -> bytes:
        name = self._name(key)
        return self._open(name, self.store.get(name), key)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        name = self._name(key)
        current = self.store.compare_set(name, self._seal(name, expected) if expected else b"",
                                         self._seal(name, desired))
        return self._open(name, current, key)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self._name(key), amount)

    def check(self, keys: list[str]) -> bool:
        return self.store.check([self._name(key) for key in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        names = [self._name(key) for key in keys]
        if timeout is None:
            self.store.wait(names)
        else:
            self.store.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(self._name(key))

    def num_keys(self) -> int:
        return self.store.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self.store.set_timeout(timeout)


def _file_store(path: Path, world_size: int, timeout: timedelta) -> dist.FileStore:
    """A store in `path`, whose folder must be this user's and closed to everyone else (no other
    user can open the file then, whatever the umask); a missing or open folder is refused."""
    try:
        folder = path.parent.lstat()
    except OSError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"the rendezvous folder {path.parent}: {exc.strerror} (a worker "
                            "that does not share the orchestrator's /tmp: give --dist-port to meet over TCP)") from None
    if not path.is_absolute() or not stat.S_ISDIR(folder.st_mode) or folder.st_uid != os.geteuid() \
            or folder.st_mode & 0o077:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"the rendezvous file {path} must be in a folder of this user's "
                            "that no one else may enter (mode 0700)")
    store = dist.FileStore(str(path), world_size)
    store.set_timeout(timeout)
    return store


def _store_client(host: str, port: int, world_size: int, timeout: timedelta,
                  abort: Callable[[], str | None]) -> dist.TCPStore:
    """A client of the store at host:port, given up when `abort` says so or after `timeout`. The
    client is made on a thread of its own: torch's waits without end for the answer of whatever
    accepted the connection (a process other than rank 0 that holds the port never answers), and
    the worker must stay able to give up. Such a thread ends when that process closes the connection."""
    made: dict[str, Any] = {}

    def connect() -> None:
        try:
            made["store"] = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        except Exception as exc:  # (DistNetworkError, DistStoreError: a RuntimeError, or not)
            made["error"] = exc

    thread = threading.Thread(target=connect, name="shardspec-rendezvous", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout.total_seconds()
    while thread.is_alive():
        thread.join(ABORT_POLL_S)
        if thread.is_alive() and (why := abort()) is not None:
            raise ProtocolError(ErrorCode.BAD_STATE, f"gave up joining the group's rendezvous at {host}:{port}: {why}")
        if thread.is_alive() and time.monotonic() > deadline:
            raise ProtocolError(ErrorCode.BAD_STATE, f"the group's rendezvous at {host}:{port} did not answer in "
                                f"{timeout.total_seconds():g}s: rank 0 is not there, or another process holds the port")
    if "error" in made:
        raise made["error"]
    return made["store"]


def _rendezvous_listener(host: str, port: int) -> socket.socket:
    address = _listen_address(host)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(128)
    except OSError as exc:
        listener.close()
        raise ProtocolError(ErrorCode.BAD_STATE, f"cannot host the process group's rendezvous on port {port}: "
                            f"{exc.strerror or exc}; choose a free port with --dist-port (by default it is the first "
                            "port above rank 0's that this group's workers do not use: each uses its port and the next "
                            "two, so another service there needs --dist-port or ports further apart)") from None
    if not address:
        log.info("the rendezvous store listens on every interface (%s: not this host's address, or a name "
                 "for loopback here only)", host)
    return listener


def _listen_address(host: str) -> str:
    """Where rank 0's store listens: HOST's address, the one the other ranks reach it at, so that no
    other interface exposes it; "" (every interface) when this host does not have that address
    (behind NAT) or HOST is a name that resolves to a loopback address here only (Debian's
    /etc/hosts: the other hosts resolve it to a reachable one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        address = str(socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)[0][4][0])
        if ipaddress.ip_address(address).is_loopback and not _names_loopback(host):
            return ""
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))  # EADDRNOTAVAIL: not this host's
        return address
    except OSError:
        return ""


def _names_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
