"""CURVE keys (ZeroMQ's authentication and encryption) in ZeroMQ's certificate format.

A key pair is two files as `zmq.auth` writes them: `NAME.key` (public, give it to peers) and
`NAME.key_secret` (keep it private). Workers hold a pair and a list of client public keys they
accept; orchestrators hold a pair and the workers' public keys.
"""

from __future__ import annotations

import ipaddress
import socket
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


def is_local(address: str) -> bool:
    """ipc:// and loopback tcp:// addresses: no traffic leaves this machine."""
    if address.startswith("ipc://"):
        return True
    host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except (OSError, ValueError):
            return False


def make_server(sock: zmq.Socket, pair: KeyPair) -> None:
    sock.curve_secretkey = pair.secret
    sock.curve_publickey = pair.public
    sock.curve_server = True


def make_client(sock: zmq.Socket, pair: KeyPair, server_public: bytes) -> None:
    sock.curve_secretkey = pair.secret
    sock.curve_publickey = pair.public
    sock.curve_serverkey = server_public
