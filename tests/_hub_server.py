"""A Hugging Face Hub on 127.0.0.1: as much of its HTTP API as huggingface_hub's client uses.

What huggingface_hub 2.4 asks (``hf_api.py``, ``file_download.py``, ``_snapshot_download.py``)
and what huggingface.co answers::

    GET  /api/models/{repo}[/revision/{rev}][?blobs=True] model info: sha, siblings (+ size,
                                                         blobId, lfs {sha256, size, pointerSize})
    GET  /api/models/{repo}/tree/{rev}?recursive=True    every file: path, size, oid, lfs
    HEAD /{repo}/resolve/{rev}/{path}                    X-Repo-Commit, ETag, Content-Length
                                                         (X-Linked-Etag/-Size: an LFS file)
    GET  /{repo}/resolve/{rev}/{path}                    the bytes (206 for a Range: a resume)

A revision is a branch, a tag or a commit sha. A file is stored through Git LFS when its name
ends with one of ``LFS_SUFFIXES`` or the repo lists it in ``lfs``: as on the Hub, its git blob
id (``blobId``, the tree's ``oid``) is then the id of its LFS pointer, and the sha256 of its
bytes is the ``lfs`` entry's (and the ``X-Linked-Etag`` of its HEAD). Errors carry the ``X-Error-Code`` that
huggingface_hub types them by: ``RepoNotFound`` (401, as the Hub answers a client without a
token), ``RevisionNotFound`` and ``EntryNotFound`` (404), ``GatedRepo`` (401 without a
token, 403 with another one). A gated repo's metadata is public and its files are not, as on
the Hub. ``die_during(path)``: the next GET of ``path`` sends half its bytes, then the whole
server goes away (its listening socket closed), as a Hub that drops off mid-download.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

#: What the Hub stores through Git LFS: served with X-Linked-Etag = the file's sha256.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".onnx")

_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    """The Git LFS pointer file the Hub's git holds in place of an LFS file's bytes."""
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:"
            f"{hashlib.sha256(data).hexdigest()}\nsize {len(data)}\n").encode()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> path -> bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha
    token: str | None = None  # gated: files need "Authorization: Bearer <token>"
    lfs: set[str] = field(default_factory=set)  # stored through LFS besides LFS_SUFFIXES

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES) or path in self.lfs

    def commit_of(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


def add_commit(repos: dict[str, Repo], repo_id: str, files: dict[str, bytes], *refs: str) -> str:
    """Add a commit of ``files`` (its sha derived from them) that ``refs`` point to."""
    repo = repos.setdefault(repo_id, Repo())
    digest = hashlib.sha1(repo_id.encode())
    for path in sorted(files):
        digest.update(b"\0" + path.encode() + b"\0" + files[path])
    sha = digest.hexdigest()
    repo.commits[sha] = dict(files)
    for ref in refs:
        repo.refs[ref] = sha
    return sha


class FakeHub:
    """The server, on a random port of 127.0.0.1; ``url`` is what ``HF_ENDPOINT`` takes."""

    def __init__(self, repos: dict[str, Repo] | None = None) -> None:
        self.repos: dict[str, Repo] = repos if repos is not None else {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, authorization)
        self._dying: set[str] = set()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.alive = True

    def die_during(self, path: str) -> None:
        self._dying.add(path)

    def seen(self, method: str | None = None, suffix: str = "") -> list[str]:
        with self._lock:
            return [p for m, p, _ in self.requests if (method is None or m == method)
                    and p.endswith(suffix)]

    def stop(self) -> None:
        if self.alive:
            self.alive = False
            self._server.shutdown()
            self._server.server_close()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: the test asserts on hub.requests instead

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def _reply(self, status: int, headers: dict[str, str], data: bytes = b"",
                   body: bool = True) -> None:
            self.send_response(status)
            for name, value in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(name, value)
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _error(self, status: int, code: str, message: str, body: bool,
                   extra: dict[str, str] | None = None) -> None:
            data = json.dumps({"error": message}).encode()
            self._reply(status, {"X-Error-Code": code, "X-Error-Message": message,
                                 "Content-Type": "application/json", **(extra or {})}, data, body)

        def _serve(self, body: bool) -> None:
            if not hub.alive:  # a kept-alive connection of a server that went away: no answer
                self.close_connection = True
                return
            url = urlsplit(self.path)
            path = unquote(url.path)
            auth = self.headers.get("Authorization")
            with hub._lock:
                hub.requests.append((self.command, path, auth))
            api = _API.match(url.path)
            resolve = _RESOLVE.match(url.path)
            match = api or resolve
            repo = hub.repos.get(unquote(match["repo"])) if match else None
            if match is None or repo is None:
                self._error(401, "RepoNotFound", "Repository not found", body)
                return
            revision = unquote(match["rev"] or "main")  # /api/models/{repo}: the main branch
            sha = repo.commit_of(revision)
            if sha is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", body)
                return
            files = repo.commits[sha]
            if api is not None:
                data = self._tree(repo, files) if api["kind"] == "tree" else self._info(
                    unquote(api["repo"]), sha, files, "blobs" in url.query)
                self._reply(200, {"Content-Type": "application/json"}, json.dumps(data).encode(),
                            body)
                return
            assert resolve is not None
            self._file(repo, sha, files, unquote(resolve["path"]), auth, body)

        def _info(self, repo_id: str, sha: str, files: dict[str, bytes],
                  blobs: bool) -> dict[str, Any]:
            siblings = []
            repo = hub.repos[repo_id]
            for name, data in sorted(files.items()):
                entry: dict[str, Any] = {"rfilename": name}
                if blobs and repo.is_lfs(name):
                    pointer = lfs_pointer(data)
                    entry.update(size=len(data), blobId=git_blob_sha(pointer), lfs={
                        "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                        "pointerSize": len(pointer)})
                elif blobs:
                    entry.update(size=len(data), blobId=git_blob_sha(data))
                siblings.append(entry)
            return {"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                    "gated": "manual" if hub.repos[repo_id].token else False,
                    "disabled": False, "siblings": siblings}

        def _tree(self, repo: Repo, files: dict[str, bytes]) -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            folders = sorted({name.rsplit("/", 1)[0] for name in files if "/" in name})
            for folder in folders:
                out.append({"type": "directory", "oid": git_blob_sha(folder.encode()), "size": 0,
                            "path": folder})
            for name, data in sorted(files.items()):
                lfs = repo.is_lfs(name)
                entry: dict[str, Any] = {"type": "file", "size": len(data), "path": name,
                                         "oid": git_blob_sha(lfs_pointer(data) if lfs else data)}
                if lfs:
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                    "pointerSize": len(lfs_pointer(data))}
                out.append(entry)
            return out

        def _file(self, repo: Repo, sha: str, files: dict[str, bytes], name: str,
                  auth: str | None, body: bool) -> None:
            if repo.token is not None and auth != f"Bearer {repo.token}":
                status = 401 if auth is None else 403
                self._error(status, "GatedRepo", "Access to this model is restricted: you must "
                            "be authenticated and have been granted access.", body)
                return
            data = files.get(name)
            if data is None:
                self._error(404, "EntryNotFound", f"{name} does not exist", body,
                            {"X-Repo-Commit": sha})
                return
            lfs = repo.is_lfs(name)
            etag = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha(data)
            headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            if lfs:
                headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
            start = 0
            ranged = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
            if ranged and body:
                start = int(ranged[1])
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            if body and name in hub._dying:
                hub._dying.discard(name)
                self._die(headers, data)
                return
            self._reply(206 if start else 200, headers, data[start:], body)

        def _die(self, headers: dict[str, str], data: bytes) -> None:
            """Half the bytes, then no server: this connection and the listening socket close."""
            self.send_response(200)
            for key, value in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            time.sleep(0.2)  # the other files' requests, already under way, finish first
            self.close_connection = True
            threading.Thread(target=hub.stop, daemon=True).start()
            while hub.alive or hub._thread.is_alive():
                time.sleep(0.01)  # closed only once nothing listens any more

    return Handler
