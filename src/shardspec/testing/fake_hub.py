"""A local stand-in for the Hugging Face Hub, for tests: the endpoints `huggingface_hub` calls to
resolve a revision (`/api/models/ORG/NAME[/revision/REV]`) and to fetch a file (HEAD and GET of
`/ORG/NAME/resolve/REV/FILE`, with the commit and etag headers, ranges for resumed downloads).
Point HF_ENDPOINT at `FakeHub.url`. Every file request is logged in `requests`.

    with FakeHub({"org/tiny": folder}) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp / "hf")}
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote


@dataclass
class Repo:
    """A repository of one commit on branch `main`: its files, read from a folder."""

    folder: Path
    commit: str = ""
    files: dict[str, Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.files = {p.relative_to(self.folder).as_posix(): p for p in sorted(self.folder.rglob("*")) if p.is_file()}
        if not self.commit:  # a commit id from the contents, as git would make one
            digest = hashlib.sha1()
            for name, path in self.files.items():
                digest.update(name.encode() + b"\0" + path.read_bytes())
            self.commit = digest.hexdigest()

    def etag(self, name: str) -> str:
        """The Hub's: the sha256 of a large (LFS) file, the git blob id of another."""
        data = self.files[name].read_bytes()
        if _lfs(name):
            return hashlib.sha256(data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def tree(self) -> list[dict]:
        entries = []
        for name, path in self.files.items():
            size = path.stat().st_size
            lfs = {"lfs": {"oid": self.etag(name), "size": size, "pointerSize": 134}} if _lfs(name) else {}
            entries.append({"type": "file", "path": name, "size": size, "oid": self.etag(name), **lfs})
        return entries


def _lfs(name: str) -> bool:
    return name.endswith(".safetensors")


class FakeHub:
    """An HTTP server on 127.0.0.1 answering for `repos` (id -> folder); `requests` lists each file
    request as (method, repo, revision, file)."""

    def __init__(self, repos: dict[str, Path]):
        self.repos = {repo_id: Repo(Path(folder)) for repo_id, folder in repos.items()}
        self.requests: list[tuple[str, str, str, str]] = []
        hub = self

        class Handler(_Handler):
            owner = hub

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def fetched(self, method: str = "GET") -> list[str]:
        """The files fetched (GET) so far, in order."""
        return [name for m, _, _, name in self.requests if m == method]

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    owner: FakeHub

    def log_message(self, *_args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        path = unquote(self.path.split("?", 1)[0])
        if path.startswith("/api/models/"):
            return self._info(path.removeprefix("/api/models/"))
        parts = path.lstrip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
        self._error(404, "EntryNotFound")

    def _repo(self, repo_id: str, revision: str) -> Repo | None:
        repo = self.owner.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound")
            return None
        if revision not in ("main", repo.commit):
            self._error(404, "RevisionNotFound")
            return None
        return repo

    def _info(self, rest: str) -> None:
        if "/tree/" in rest:
            repo_id, _, revision = rest.partition("/tree/")
            if (repo := self._repo(repo_id, revision.split("/")[0])) is not None:
                self._send(200, json.dumps(repo.tree()).encode(), {"Content-Type": "application/json"}, True)
            return
        repo_id, _, revision = rest.partition("/revision/")
        repo = self._repo(repo_id, revision or "main")
        if repo is None:
            return
        info = {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False, "disabled": False,
                "gated": False, "siblings": [{"rfilename": name} for name in repo.files]}
        self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, True)

    def _file(self, repo_id: str, revision: str, name: str, body: bool) -> None:
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        if name not in repo.files:
            self._error(404, "EntryNotFound")
            return
        self.owner.requests.append((self.command, repo_id, revision, name))
        data = repo.files[name].read_bytes()
        start = 0
        if body and (ranged := self.headers.get("Range", "")).startswith("bytes="):
            start = int(ranged.removeprefix("bytes=").split("-")[0] or 0)
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{repo.etag(name)}"', "Accept-Ranges": "bytes"}
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self._send(206 if start else 200, data[start:], headers, body)

    def _error(self, status: int, code: str) -> None:
        self._send(status, json.dumps({"error": code}).encode(), {"X-Error-Code": code}, self.command != "HEAD")

    def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(data)
