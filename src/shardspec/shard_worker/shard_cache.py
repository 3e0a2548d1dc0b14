"""A worker's cache of the model shards it received from an orchestrator: content-addressed blobs
(each a one-tensor safetensors file, or a small file such as tokenizer.json, named by its sha256)
under a size limit, least recently used first out; per model (by its key) a folder with config.json,
the checkpoint index and the small files, and `tensors.json` mapping tensor names to blobs.

Nothing is ever half written where a reader looks: a blob grows in `partial/` (a transfer that
stops resumes there), is fsynced, checked against its sha256 and renamed into `blobs/`; the other
files are written to a temporary name, fsynced and renamed. A full disk fails the write that hit it
and leaves the partial file as long as its last whole chunk.

    ROOT/blobs/SHA256    ROOT/partial/ID.part    ROOT/models/KEY/{config.json, tensors.json, ...}
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

log = logging.getLogger("shardspec.worker")

DEFAULT_CACHE_SIZE = 200 << 30
TENSORS_FILE = "tensors.json"
_HEX = frozenset("0123456789abcdef")


class CacheFull(Exception):
    """The cache cannot take a blob: over its size limit with nothing left to evict, or the disk is full."""


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/shardspec/shards, else ~/.cache/shardspec/shards."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shardspec" / "shards"


def is_digest(text: str, length: int = 64) -> bool:
    return len(text) == length and set(text) <= _HEX


class ShardCache:
    """`tag` names this worker's partial files (its listen address): workers that share the folder
    receive into files of their own, and a restarted worker finds its own again."""

    def __init__(self, root: str | Path | None = None, limit: int = DEFAULT_CACHE_SIZE, tag: str = ""):
        self.root = Path(root) if root is not None else default_cache_dir()
        self.limit = limit
        self.tag = tag
        self.used: int | None = None  # bytes of blobs and partial files, as last counted plus what came since
        self.make_folders()

    def make_folders(self) -> None:
        """Its folders, made again where an operator emptied the cache while the worker ran."""
        for sub in ("blobs", "partial", "models"):
            (self.root / sub).mkdir(parents=True, exist_ok=True, mode=0o700)

    # --- models ---------------------------------------------------------------------------------

    def model_folder(self, key: str) -> Path:
        if not is_digest(key):
            raise ValueError(f"a model key is a sha256 in hex, got {key!r}")
        return self.root / "models" / key

    def tensors(self, key: str) -> dict[str, str]:
        """Tensor name -> blob of the model `key`, for the blobs still in the cache."""
        try:
            held = json.loads((self.model_folder(key) / TENSORS_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return {name: blob for name, blob in held.items() if self.blob(blob).is_file()}

    def write_file(self, key: str, name: str, data: bytes) -> None:
        """A small file of model `key`'s folder (config.json, the index, tokenizer.json), atomically."""
        folder = self.model_folder(key)
        folder.mkdir(exist_ok=True, mode=0o700)
        _write_atomic(folder / _plain(name), data)

    def add_tensors(self, key: str, added: dict[str, str]) -> None:
        """Record tensors of model `key` as held in blobs (merged with what other workers that
        share the cache recorded)."""
        folder = self.model_folder(key)
        folder.mkdir(exist_ok=True, mode=0o700)
        _fsync_dir(self.root / "blobs")  # their renames first
        with self._locked():
            held = {**self.tensors(key), **added}
            _write_atomic(folder / TENSORS_FILE, json.dumps(held, sort_keys=True).encode())

    # --- blobs ----------------------------------------------------------------------------------

    def blob(self, digest: str) -> Path:
        return self.root / "blobs" / digest

    def touch(self, digests: Iterable[str]) -> None:
        """Mark blobs as just used (the LRU order is the blobs' modification times)."""
        now = time.time()
        for digest in digests:
            with contextlib.suppress(OSError):
                os.utime(self.blob(digest), (now, now))

    def partial(self, key: str, item: str) -> Path:
        return self.root / "partial" / (hashlib.sha256(f"{self.tag}\0{key}\0{item}".encode()).hexdigest() + ".part")

    def held_bytes(self, key: str, item: str) -> int:
        """Bytes of `item` already received into its partial file."""
        try:
            return self.partial(key, item).stat().st_size
        except OSError:
            return 0

    def append(self, key: str, item: str, offset: int, data: memoryview) -> int:
        """Write a chunk at `offset` of `item`'s partial file (0 starts it again); its new length.
        On a failed write (a full disk) the file is cut back to its length before, and CacheFull raised."""
        path = self.partial(key, item)
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_TRUNC if offset == 0 else 0)
        fd = os.open(path, flags, 0o600)
        try:
            try:
                written = 0
                while written < len(data):
                    written += os.pwrite(fd, data[written:], offset + written)
            except OSError as exc:
                os.ftruncate(fd, offset)
                raise CacheFull(f"cannot write to the shard cache at {self.root}: {exc.strerror} "
                                "(free space on that disk, or give the worker another --cache-dir)") from None
            return offset + written
        finally:
            os.close(fd)

    def partial_digest(self, key: str, item: str) -> hashlib._Hash:
        """The sha256 of what `item`'s partial file holds so far, to go on hashing as chunks come."""
        digest = hashlib.sha256()
        with contextlib.suppress(FileNotFoundError), open(self.partial(key, item), "rb") as f:
            digest = hashlib.file_digest(f, "sha256")
        return digest

    def commit(self, key: str, item: str, digest: str, found: str | None = None) -> Path:
        """Move `item`'s finished partial file into the blobs if its contents hash to `digest`
        (`found`: their hash, taken as the chunks were written; else read here); ValueError (the
        partial file removed) if not."""
        path = self.partial(key, item)
        with open(path, "rb") as f:
            found = found or hashlib.file_digest(f, "sha256").hexdigest()
            os.fsync(f.fileno())
        if found != digest:
            path.unlink(missing_ok=True)
            raise ValueError(f"{item}: received bytes hash to {found}, the sender's to {digest}")
        target = self.blob(digest)
        os.replace(path, target)  # (the folder is fsynced when the blob is recorded: add_tensors)
        return target

    def check_room(self, whole: int, what: str) -> None:
        """CacheFull before any byte is written or evicted where `whole` bytes (`what`) could never be
        in the cache at once: past its size limit, or past the disk's free space and all the cache holds."""
        if whole > self.limit:
            raise CacheFull(f"the shard cache at {self.root} cannot hold {what}: it takes {whole / 1e6:.1f} MB, over "
                            f"its limit of {self.limit / 1e6:.1f} MB: raise the worker's --cache-size")
        held = sum(_size(p) for sub in ("blobs", "partial") for p in (self.root / sub).iterdir())
        if whole > (free := shutil.disk_usage(self.root).free) + held:
            raise CacheFull(f"the disk of the shard cache at {self.root} cannot hold {what}: it takes "
                            f"{whole / 1e6:.1f} MB, and has {free / 1e6:.1f} MB free besides the cache's "
                            f"{held / 1e6:.1f} MB (free space on that disk, or give the worker another --cache-dir)")

    def make_room(self, incoming: int, keep: Callable[[], set[str]], writing: Path | None = None) -> None:
        """Evict the least recently used blobs and partial files (not the blobs in `keep()`, nor the
        partial file being written) until `incoming` more bytes fit the size limit and the disk;
        CacheFull if they cannot. The folder is counted again only when the count kept here (other
        workers may share the folder) says the limit is near."""
        if self.used is not None and self.used + incoming <= 0.9 * self.limit and \
                incoming <= shutil.disk_usage(self.root).free:
            self.used += incoming
            return
        with self._locked():
            keep_names = keep()
            files = [(p.stat().st_mtime, p.stat().st_size, p) for sub in ("blobs", "partial")
                     for p in (self.root / sub).iterdir() if p.is_file()]
            used = sum(size for _, size, _ in files)
            for _, size, path in sorted(files, key=lambda entry: entry[0]):
                if used + incoming <= self.limit and incoming <= shutil.disk_usage(self.root).free:
                    break
                if path.name in keep_names or path == writing:
                    continue
                path.unlink(missing_ok=True)
                used -= size
                log.info("shard cache: evicted %s (%.1f MB), the least recently used", path.name[:12], size / 1e6)
            if used + incoming > self.limit:
                raise CacheFull(f"the shard cache at {self.root} holds {used / 1e6:.1f} MB in use and needs "
                                f"{incoming / 1e6:.1f} MB more, over its limit of {self.limit / 1e6:.1f} MB: raise "
                                "the worker's --cache-size")
            if (free := shutil.disk_usage(self.root).free) < incoming:
                raise CacheFull(f"the disk of the shard cache at {self.root} has {free / 1e6:.1f} MB "
                                f"free, {incoming / 1e6:.1f} MB are needed (free space on that disk, or give the "
                                "worker another --cache-dir)")
            self.used = used + incoming

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Across the workers that share this cache folder."""
        with open(self.root / "lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def _size(path: Path) -> int:
    """A file's size; 0 for one that another worker sharing the folder has just evicted."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _plain(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"a model file of the cache is a plain name, got {name!r}")
    return name


def _write_atomic(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise CacheFull(f"cannot write {path}: {exc.strerror}") from None
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
