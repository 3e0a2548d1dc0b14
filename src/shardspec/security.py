"""CURVE keys (ZeroMQ's authentication and encryption) in ZeroMQ's certificate format.

A key pair is two files as `zmq.auth` writes them: `NAME.key` (public, give it to peers) and
`NAME.key_secret` (keep it private). Workers hold a pair and a list of client public keys they
accept; orchestrators hold a pair and the workers' public keys.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth


class KeyFileError(ValueError):
    """A key file or folder that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class KeyPair:
    public: bytes
    secret: bytes


def generate(folder: str | Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key and NAME.key_secret into `folder`; refuse to overwrite a pair."""
    folder = Path(folder)
    if (folder / f"{name}.key_secret").exists():
        raise KeyFileError(f"{folder / (name + '.key_secret')} exists; not overwriting a secret key")
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(folder), name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def load_pair(path: str | Path) -> KeyPair:
    """A key pair from a `*.key_secret` file, or from a folder holding exactly one."""
    path = Path(path)
    if path.is_dir():
        secrets = sorted(path.glob("*.key_secret"))
        if len(secrets) != 1:
            raise KeyFileError(f"{path} must hold exactly one *.key_secret file, found {len(secrets)}")
        path = secrets[0]
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot read a key pair from {path}: {exc}") from None
    if secret is None:
        raise KeyFileError(f"{path} holds no secret key (give the .key_secret file or its folder)")
    return KeyPair(public, secret)


def load_public_keys(path: str | Path) -> list[bytes]:
    """Public keys from a `*.key` file, or from every `*.key` file of a folder (sorted by name)."""
    path = Path(path)
    files = sorted(path.glob("*.key")) if path.is_dir() else [path]
    if not files:
        raise KeyFileError(f"no *.key public key files in {path}")
    keys = []
    for file in files:
        try:
            keys.append(zmq.auth.load_certificate(str(file))[0])
        except (OSError, ValueError) as exc:
            raise KeyFileError(f"cannot read a public key from {file}: {exc}") from None
    return keys


def reaches_other_users(address: str) -> bool:
    """Whether other users of this machine (or other machines) can connect to a listen address:
    every tcp:// one, loopback too, and abstract ipc://@NAME (no file, so no permissions). A
    filesystem ipc:// socket is made owner-only (see `private_umask`)."""
    return not address.startswith("ipc://") or address.startswith("ipc://@")


def ipc_socket_file(address: str) -> Path | None:
    """The file of a filesystem ipc:// address; None for tcp:// and abstract ipc://@NAME."""
    if not address.startswith("ipc://") or address.startswith("ipc://@"):
        return None
    return Path(address[len("ipc://") :])


def check_ipc_free(address: str) -> None:
    """Refuse (ValueError) an ipc:// address that a live process listens on, or whose path is not
    a socket, instead of letting libzmq take it over; a stale socket file is fine. Makes a missing
    parent folder owner-only, and refuses one that other users may rename files in."""
    if not address.startswith("ipc://"):
        return
    path = ipc_socket_file(address)
    target = "\0" + address[len("ipc://@") :] if path is None else str(path)
    if path is not None:
        _check_private_parent(path.parent)
        if not path.exists() and not path.is_symlink():
            return
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ValueError(f"{path} exists and is not a socket: choose another ipc:// path")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(target)
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return  # nobody listens: a stale file, or a free name
            raise ValueError(f"cannot check whether {address} is in use: {exc.strerror or exc}") from None
    raise ValueError(f"{address} is in use by a running process (another worker?): stop it or choose another path")


def _check_private_parent(folder: Path) -> None:
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True)
        return
    mode = folder.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        raise ValueError(f"{folder} is writable by other users, who could replace the worker's socket: put it in "
                         "a folder only you can write to")


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Files created inside are readable and writable by their owner only."""
    previous = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(previous)


def make_server(sock: zmq.Socket, pair: KeyPair) -> None:
    sock.curve_secretkey = pair.secret
    sock.curve_publickey = pair.public
    sock.curve_server = True


def make_client(sock: zmq.Socket, pair: KeyPair, server_public: bytes) -> None:
    sock.curve_secretkey = pair.secret
    sock.curve_publickey = pair.public
    sock.curve_serverkey = server_public
