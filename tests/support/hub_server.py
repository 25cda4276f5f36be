"""A local stand-in for the Hugging Face Hub: the part of its HTTP API that the real `huggingface_hub` client uses
to pull a model, on 127.0.0.1 (HF_ENDPOINT=http://127.0.0.1:PORT).

- GET /api/models/ORG/NAME[/revision/REV]: the repo's info with files metadata (sha, siblings with size, blobId
  and lfs {sha256, size, pointerSize}); 401 RepoNotFound for a missing or private repo without its token, 403
  GatedRepo for a gated one, 404 RevisionNotFound for an unknown revision.
- HEAD/GET /ORG/NAME/resolve/REV/PATH: a small (git) file directly, with ETag (its git blob id), X-Repo-Commit and
  Content-Length; an LFS file as the Hub serves it, a 302 to another host (`localhost`, the "CDN") with
  X-Linked-Etag (its sha256) and X-Linked-Size.
- GET /cdn/SHA256 on that host: the bytes, with Range (206, Content-Range) as a CDN answers.

Faults for the tests: `drop_after[path] = n` sends n bytes of the first GET of a file and drops the connection;
`hold_after[path] = n` sends n bytes and waits until `release()` (the client can then be interrupted mid-file).
`requests` logs (method, path, Range header) of every request.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "a" * 40
    private_token: str | None = None  # the token a private repo needs
    gated: bool = False
    claimed_sizes: dict[str, int] = field(default_factory=dict)  # a size the listing claims instead of the real one

    def is_lfs(self, name: str) -> bool:
        return name.endswith(LFS_SUFFIXES)


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.by_sha: dict[str, bytes] = {}
        self.drop_after: dict[str, int] = {}
        self.hold_after: dict[str, int] = {}
        self.gate = threading.Event()
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

            def do_GET(self) -> None:
                hub._handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cdn = f"http://localhost:{self.port}"  # another host name: the client drops the token there
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo_id: str, files: dict[str, bytes], **kwargs: object) -> Repo:
        repo = Repo(dict(files), **kwargs)  # type: ignore[arg-type]
        self.repos[repo_id] = repo
        for data in files.values():
            self.by_sha[hashlib.sha256(data).hexdigest()] = data
        return repo

    def release(self) -> None:
        self.gate.set()

    # ---- answering ------------------------------------------------------------------------------------

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _repo(self, h: BaseHTTPRequestHandler, repo_id: str) -> Repo | None:
        repo = self.repos.get(repo_id)
        auth = h.headers.get("Authorization", "")
        if repo is None or (repo.private_token and auth != f"Bearer {repo.private_token}"):
            self._error(h, 401, "RepoNotFound", "Repository not found")
            return None
        if repo.gated and not auth:
            self._error(h, 403, "GatedRepo", "Access to model is restricted: you must accept its terms")
            return None
        return repo

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append(("HEAD" if head else "GET", path, h.headers.get("Range")))
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?", path):
            return self._info(h, m.group(1), m.group(2))
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            return self._resolve(h, m.group(1), m.group(2), m.group(3), head)
        if m := re.fullmatch(r"/cdn/([0-9a-f]{64})/(.+)", path):
            return self._send_bytes(h, self.by_sha.get(m.group(1)), m.group(2), head)
        self._error(h, 404, "NotFound", f"no route {path}")

    def _info(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str | None) -> None:
        repo = self._repo(h, repo_id)
        if repo is None:
            return
        if revision not in (None, "main", repo.commit):
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
        siblings = []
        for name, data in sorted(repo.files.items()):
            size = repo.claimed_sizes.get(name, len(data))
            entry: dict[str, object] = {"rfilename": name, "size": size, "blobId": git_blob_id(data)}
            if repo.is_lfs(name):
                entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": size, "pointerSize": 134}
            siblings.append(entry)
        body = json.dumps({"_id": "x", "id": repo_id, "modelId": repo_id, "sha": repo.commit, "private":
                           bool(repo.private_token), "gated": repo.gated, "disabled": False, "tags": [],
                           "siblings": siblings}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _resolve(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str, name: str, head: bool) -> None:
        repo = self._repo(h, repo_id)
        if repo is None:
            return
        if revision not in ("main", repo.commit):
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
        data = repo.files.get(name)
        if data is None:
            return self._error(h, 404, "EntryNotFound", f"{name} does not exist")
        if repo.is_lfs(name):
            sha = hashlib.sha256(data).hexdigest()
            h.send_response(302)
            h.send_header("Location", f"{self.cdn}/cdn/{sha}/{name}")
            h.send_header("X-Linked-Etag", f'"{sha}"')
            h.send_header("X-Linked-Size", str(len(data)))
            h.send_header("X-Repo-Commit", repo.commit)
            h.send_header("ETag", f'"{git_blob_id(data)}"')
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        h.send_response(200)
        h.send_header("X-Repo-Commit", repo.commit)
        h.send_header("ETag", f'"{git_blob_id(data)}"')
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if not head:
            h.wfile.write(data)

    def _send_bytes(self, h: BaseHTTPRequestHandler, data: bytes | None, name: str, head: bool) -> None:
        if data is None:
            return self._error(h, 404, "EntryNotFound", "no such blob")
        start = 0
        if (rng := h.headers.get("Range")) and (m := re.fullmatch(r"bytes=(\d+)-", rng)):
            start = int(m.group(1))
            h.send_response(206)
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            h.send_response(200)
        h.send_header("Content-Length", str(len(data) - start))
        h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        h.send_header("Accept-Ranges", "bytes")
        h.end_headers()
        if head:
            return
        body = data[start:]
        cut = self.drop_after.pop(name, None)
        hold = self.hold_after.pop(name, None)
        if cut is not None:  # a dropped connection mid-file
            h.wfile.write(body[:cut])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)
            return
        if hold is not None:  # a stall mid-file, until release()
            h.wfile.write(body[:hold])
            h.wfile.flush()
            self.gate.wait(60)
            body = body[hold:]
        try:
            h.wfile.write(body)
        except OSError:
            h.close_connection = True
