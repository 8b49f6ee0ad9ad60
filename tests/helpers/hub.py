"""A fake Hugging Face Hub on 127.0.0.1 for the hf:// tests: the Hub's dataset routes (info, tree, resolve)
and a CDN of signed blob URLs on a second port, so huggingface_hub's own client and our ranged reader run
against it as against huggingface.co, with the faults (429, expired URLs, cut connections) a test needs.

Faithful to huggingface_hub 2.4.0 (tests/data/sources/test_hub_fake.py drives it with that client): errors carry
X-Error-Code / X-Error-Message as hf_raise_for_status maps them; an LFS file's HEAD is a 302 to another
origin, which get_hf_file_metadata does not follow, so its metadata comes from X-Linked-* headers."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import http.server
import itertools
import json
import math
import os
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_MIN_SIZE = 1024
_NAME = r"[\w.-]+"
_INFO = re.compile(rf"^/api/(?:datasets|models)/({_NAME}/{_NAME})(?:/revision/([^/]+))?/?$")
_TREE = re.compile(rf"^/api/datasets/({_NAME}/{_NAME})/tree/([^/]+)(?:/(.*))?$")
_RESOLVE = re.compile(rf"^/(?:datasets/)?({_NAME}/{_NAME})/resolve/([^/]+)/(.+)$")  # a data set's, or a model's
_BLOB = re.compile(r"^/blobs/([0-9a-f]{64})$")
_SHA = re.compile(r"^[0-9a-f]{40}$")
_S3_ERROR = '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>{}</Message></Error>'
Files = dict[str, bytes | Path] | Path


def is_lfs(path: str, data: bytes) -> bool:
    """The one rule for which files the fake stores in LFS (served by a 302 to the CDN)."""
    return path.endswith(".tar") or len(data) > LFS_MIN_SIZE


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(data: bytes) -> bytes:
    sha = hashlib.sha256(data).hexdigest()
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n".encode()


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(t))


def _under(files: dict[str, bytes], path: str) -> dict[str, bytes]:
    return {p: d for p, d in files.items() if not path or p == path or p.startswith(path + "/")}


class HubError(Exception):
    """An error answer: status, X-Error-Code (None for none), X-Error-Message, extra headers."""

    def __init__(self, status: int, code: str | None, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


@dataclass
class Commit:
    sha: str
    files: dict[str, bytes]
    parent: Commit | None
    title: str
    date: float


@dataclass
class Repo:
    id: str
    gated: bool
    private: bool
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)


@dataclass
class _Signed:
    sha256: str
    expires: int
    key: str
    uses: int = 0
    revoked: bool = False


class _Server(http.server.ThreadingHTTPServer):
    """Keeps its open connections, so stop() can close the idle keep-alive ones too."""

    daemon_threads = True

    def __init__(self, port: int, handler: type, hub: Hub):
        self.hub, self.conns = hub, set()
        super().__init__(("127.0.0.1", port), handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.conns.discard(request)
        super().shutdown_request(request)


class _Handler(http.server.BaseHTTPRequestHandler):
    """Shared plumbing: answers with Content-Length (HTTP/1.1 keep-alive), JSON errors, byte ranges."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def _answer(self, status: int, body: bytes, headers: dict[str, str], head: bool, key: str | None = None) -> None:
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self._write(body, key)

    def _write(self, body: bytes, key: str | None) -> None:
        cut = self.server.hub._take_cut() if key is not None else None
        out = body if cut is None else body[:cut]
        # Counted before the bytes leave, so a client that has read them sees them counted.
        if key is not None:
            self.server.hub._count("cdn_bytes", key, len(out))
        try:
            self.wfile.write(out)
        except OSError:
            if key is not None:
                self.server.hub._count("cdn_bytes", key, -len(out))
        if cut is not None:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    def _ranged(self, data: bytes, headers: dict[str, str], head: bool, key: str | None = None) -> None:
        """200 with all of ``data``, or 206 / 416 for a ``Range: bytes=a-b | a- | -n`` header."""
        want, size = self.headers.get("Range"), len(data)
        headers = {"Accept-Ranges": "bytes", **headers}
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", want.strip()) if want else None
        if m is None or m.groups() == ("", ""):
            self._answer(200, data, headers, head, key)
            return
        a, b = m.groups()
        first, last = (size - int(b), size - 1) if a == "" else (int(a), min(int(b or size - 1), size - 1))
        if first >= size or first > last or first < 0:
            self._answer(416, b"", {**headers, "Content-Range": f"bytes */{size}"}, head)
            return
        headers["Content-Range"] = f"bytes {first}-{last}/{size}"
        self._answer(206, data[first : last + 1], headers, head, key)


class _HubHandler(_Handler):
    """huggingface.co's dataset routes: /api/datasets/… (info, tree) and /datasets/…/resolve/…;
    and a model's info and files (/api/models/…, /ORG/NAME/resolve/…), from the same repos."""

    def _dispatch(self, head: bool) -> None:
        hub, url = self.server.hub, urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        resolve = _RESOLVE.match(url.path)
        try:
            hub._throttle("resolvers" if resolve else "api")
            token = self._token()
            if resolve:
                self._resolve(head, token, *resolve.groups())
            elif m := _TREE.match(url.path):
                hub._count("api_requests", m[1])
                self._tree(head, token, query, *m.groups())
            elif m := _INFO.match(url.path):
                hub._count("api_requests", m[1])
                data = hub._info(m[1], unquote(m[2] or "main"), token, query.get("blobs") in ("true", "True", "1"))
                self._answer(200, json.dumps(data).encode(), {"Content-Type": "application/json"}, head)
            else:
                raise HubError(404, None, "Sorry, we can't find the page you are looking for.")
        except HubError as e:
            body = json.dumps({"error": e.message}).encode()
            code = {"X-Error-Code": e.code} if e.code else {}
            headers = {"Content-Type": "application/json", **code, "X-Error-Message": e.message, **e.headers}
            self._answer(e.status, body, headers, head)

    def _token(self) -> str | None:
        token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        if token and not token.startswith("hf_"):
            raise HubError(401, None, "Invalid credentials in Authorization header")
        return token or None

    def _tree(self, head: bool, token: str | None, query: dict[str, str], repo_id: str, rev: str, path: str | None):
        hub = self.server.hub
        recursive, expand = (query.get(k) in ("true", "True", "1") for k in ("recursive", "expand"))
        entries = hub._tree(repo_id, unquote(rev), unquote(path or ""), token, recursive, expand)
        size = min(hub.page_size, 50) if expand else hub.page_size
        start = int(query.get("cursor", 0))
        headers = {"Content-Type": "application/json"}
        if start + size < len(entries):
            rest = "&".join(f"{k}={quote(v)}" for k, v in {**query, "cursor": str(start + size)}.items())
            headers["Link"] = f'<{hub.endpoint}{urlsplit(self.path).path}?{rest}>; rel="next"'
        self._answer(200, json.dumps(entries[start : start + size]).encode(), headers, head)

    def _resolve(self, head: bool, token: str | None, repo_id: str, rev: str, path: str) -> None:
        hub, path = self.server.hub, unquote(path)
        hub._count("resolves", f"{repo_id}/{path}")
        commit = hub._commit(repo_id, unquote(rev), token, files=True)
        data = commit.files.get(path)
        if data is None:
            raise HubError(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": commit.sha})
        headers = {"X-Repo-Commit": commit.sha}
        if not is_lfs(path, data):
            self._ranged(data, {**headers, "ETag": f'"{_git_oid(data)}"', "Content-Type": "text/plain"}, head)
            return
        sha256 = hashlib.sha256(data).hexdigest()
        location = hub._sign(sha256, f"{repo_id}/{path}")
        headers.update({"Location": location, "X-Linked-Size": str(len(data)), "X-Linked-Etag": f'"{sha256}"'})
        headers["ETag"] = f'"{_git_oid(_lfs_pointer(data))}"'
        self._answer(302, f"Found. Redirecting to {location}".encode(), headers, head)


class _CdnHandler(_Handler):
    """The CDN: /blobs/{sha256}?expires=&sig=, whole or ranged, 403 (S3's XML) once expired or forged."""

    def _dispatch(self, head: bool) -> None:
        hub, url = self.server.hub, urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if auth := self.headers.get("Authorization"):
            hub.cdn_authorization.append(auth)  # a token that left the Hub
        m = _BLOB.match(url.path)
        signed, why = hub._check_signed(m[1] if m else "", query.get("expires", ""), query.get("sig", ""))
        if signed is None:
            self._answer(403, _S3_ERROR.format(why).encode(), {"Content-Type": "application/xml"}, head)
            return
        hub._count("cdn_requests", signed.key)
        headers = {"Content-Type": "application/octet-stream", "ETag": f'"{signed.sha256}"'}
        self._ranged(hub._blobs[signed.sha256], headers, head, key=signed.key)


class Hub:
    """The fake Hub and its CDN. ``with Hub() as hub:`` (or start()/stop()); then ``hub.endpoint``.

    page_size: tree entries per page (50 at most with expand=true, as the Hub); url_ttl: seconds a signed
    CDN URL stays valid; url_uses: requests one signed URL serves before it answers 403 (None: any)."""

    def __init__(self, page_size: int = 1000, url_ttl: float = 3600.0, url_uses: int | None = None, port: int = 0):
        self.page_size, self.url_ttl, self.url_uses, self.port = page_size, url_ttl, url_uses, port
        self.endpoint = self.cdn = ""
        self.repos: dict[str, Repo] = {}
        self.grants: dict[str, set[str]] = {}  # token -> the gated or private repos it may read
        self._blobs: dict[str, bytes] = {}  # sha256 -> bytes
        self._signed: dict[str, _Signed] = {}  # sig -> what the URL serves
        self._secret, self._ids, self._lock = os.urandom(16), itertools.count(1), threading.RLock()
        self._limited, self._retry_after, self._cuts, self._servers = 0, 1, [], []
        self.reset_counts()

    def start(self) -> Hub:
        for port, handler in ((self.port, _HubHandler), (0, _CdnHandler)):
            server = _Server(port, handler, self)
            threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
            self._servers.append(server)
        self.endpoint, self.cdn = (f"http://127.0.0.1:{s.server_address[1]}" for s in self._servers)
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            for conn in list(server.conns):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            server.server_close()
        self._servers.clear()

    def __enter__(self) -> Hub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_repo(self, repo_id: str, files: Files, gated: bool = False, private: bool = False) -> str:
        """A dataset repo whose ``main`` holds ``files`` (a dict, or a folder's files); its commit sha."""
        with self._lock:
            self.repos[repo_id] = Repo(repo_id, gated, private)
            return self.commit(repo_id, files)

    def commit(self, repo_id: str, files: Files, delete: Iterable[str] = (), branch: str = "main") -> str:
        """Adds or replaces ``files`` and removes ``delete`` on ``branch``; older commits stay readable by sha."""
        with self._lock:
            repo = self.repos[repo_id]
            parent = repo.commits.get(repo.branches.get(branch, ""))
            tree = dict(parent.files) if parent else {}
            tree.update(_read_files(files))
            for path in delete:
                del tree[path]
            digest = hashlib.sha1(f"{next(self._ids)}\n".encode())
            for path in sorted(tree):
                digest.update(f"{path}\0{_git_oid(tree[path])}\n".encode())
            sha = digest.hexdigest()
            title = f"Update {branch}" if parent else "Initial commit"
            repo.commits[sha] = Commit(sha, tree, parent, title, time.time())
            repo.branches[branch] = sha
            for data in tree.values():
                self._blobs[hashlib.sha256(data).hexdigest()] = data
            return sha

    def branch(self, repo_id: str, name: str, sha: str) -> None:
        """Points branch ``name`` (e.g. "refs/pr/1") at commit ``sha``."""
        with self._lock:
            assert sha in self.repos[repo_id].commits, sha
            self.repos[repo_id].branches[name] = sha

    def grant(self, token: str, repo_id: str) -> None:
        """Lets ``token`` (any "hf_…" string is a valid token; others get 401) read a gated or private repo."""
        with self._lock:
            self.grants.setdefault(token, set()).add(repo_id)

    def rate_limit(self, n: int, retry_after: int = 1) -> None:
        """The next ``n`` Hub requests (API or resolve; not the CDN) answer 429 with Retry-After."""
        with self._lock:
            self._limited, self._retry_after = n, retry_after

    def cut_after(self, nbytes: int, times: int = 1) -> None:
        """The next ``times`` CDN bodies stop after ``nbytes`` bytes and their connection closes."""
        with self._lock:
            self._cuts.extend([nbytes] * times)

    def expire_urls(self) -> None:
        """Every signed URL handed out so far answers 403 from now on (new resolves sign new ones)."""
        with self._lock:
            for signed in self._signed.values():
                signed.revoked = True

    def reset_counts(self) -> None:
        """cdn_bytes / cdn_requests / resolves: per "org/name/path"; api_requests: per "org/name"."""
        with self._lock:
            self.cdn_bytes, self.cdn_requests, self.resolves, self.api_requests = (Counter() for _ in range(4))
            self.rate_limited, self.cdn_authorization = 0, []

    def _count(self, name: str, key: str, n: int = 1) -> None:
        with self._lock:
            getattr(self, name)[key] += n

    def _take_cut(self) -> int | None:
        with self._lock:
            return self._cuts.pop(0) if self._cuts else None

    def _throttle(self, bucket: str) -> None:
        with self._lock:
            if self._limited <= 0:
                return
            self._limited -= 1
            self.rate_limited += 1
            wait = self._retry_after
        headers = {"Retry-After": str(wait), "RateLimit": f'"{bucket}";r=0;t={wait}'}
        headers["RateLimit-Policy"] = f'"fixed window";"{bucket}";q=500;w=300'
        raise HubError(429, None, f"You have exceeded our '{bucket}' rate limit. Retry after {wait} seconds.", headers)

    def _repo(self, repo_id: str, token: str | None, files: bool) -> Repo:
        """The repo, or the errors the Hub gives: unknown/private 401 (no token) or 404, gated 401 or 403."""
        with self._lock:
            repo = self.repos.get(repo_id)
            allowed = repo_id in self.grants.get(token or "", set())
        if repo is None or (repo.private and not allowed):
            if token is None:
                raise HubError(401, "RepoNotFound", "Invalid username or password.")
            raise HubError(404, "RepoNotFound", "Repository not found")
        if repo.gated and files and not allowed:
            what = f"Access to dataset {repo_id} is restricted"
            if token is None:
                raise HubError(401, "GatedRepo", f"{what}. You must be authenticated to access it.")
            raise HubError(403, "GatedRepo", f"{what} and you are not in the authorized list.")
        return repo

    def _commit(self, repo_id: str, rev: str, token: str | None, files: bool) -> Commit:
        repo = self._repo(repo_id, token, files)
        with self._lock:
            sha = repo.branches.get(rev) or (rev if _SHA.match(rev) else None)
            commit = repo.commits.get(sha or "")
        if commit is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return commit

    def _info(self, repo_id: str, rev: str, token: str | None, blobs: bool) -> dict[str, Any]:
        commit = self._commit(repo_id, rev, token, files=False)
        repo = self.repos[repo_id]
        siblings = []
        for path, data in sorted(commit.files.items()):
            sib: dict[str, Any] = {"rfilename": path}
            if blobs:
                sib.update(size=len(data), blobId=_git_oid(_lfs_pointer(data) if is_lfs(path, data) else data))
                if is_lfs(path, data):
                    sha256, pointer = hashlib.sha256(data).hexdigest(), len(_lfs_pointer(data))
                    sib["lfs"] = {"sha256": sha256, "size": len(data), "pointerSize": pointer}
            siblings.append(sib)
        first = next(iter(repo.commits.values()))
        info = {"_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "id": repo_id, "sha": commit.sha}
        info.update(author=repo_id.split("/")[0], createdAt=_iso(first.date), lastModified=_iso(commit.date))
        info.update(private=repo.private, gated="auto" if repo.gated else False, disabled=False, downloads=0)
        info.update(likes=0, tags=[], cardData={}, siblings=siblings)
        return {**info, "usedStorage": sum(len(d) for d in commit.files.values())}

    def _tree(self, repo_id: str, rev: str, path: str, token: str | None, recursive: bool, expand: bool) -> list[dict]:
        """The entries under ``path`` (all levels with recursive=true), sorted by path."""
        commit = self._commit(repo_id, rev, token, files=False)
        path = path.strip("/")
        under = _under(commit.files, path)
        if path and (not under or path in under):
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {rev}", {"X-Repo-Commit": commit.sha})
        names: set[str] = set()
        for p in under:
            parts = p[len(path) + 1 if path else 0 :].split("/")
            depth = len(parts) if recursive else 1
            for i in range(1, depth + 1):
                names.add("/".join(filter(None, [path, *parts[:i]])))
        return [self._entry(commit, p, expand) for p in sorted(names)]

    def _entry(self, commit: Commit, path: str, expand: bool) -> dict[str, Any]:
        data = commit.files.get(path)
        if data is None:
            oids = "".join(f"{p}\0{_git_oid(d)}" for p, d in sorted(_under(commit.files, path).items()))
            entry: dict[str, Any] = {"type": "directory", "oid": hashlib.sha1(oids.encode()).hexdigest()}
            entry.update(size=0, path=path)
        elif is_lfs(path, data):
            entry = {"type": "file", "oid": _git_oid(pointer := _lfs_pointer(data)), "size": len(data), "path": path}
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": len(pointer)}
        else:
            entry = {"type": "file", "oid": _git_oid(data), "size": len(data), "path": path}
        if expand:
            last = commit
            while last.parent is not None and _under(last.parent.files, path) == _under(last.files, path):
                last = last.parent
            entry["lastCommit"] = {"id": last.sha, "title": last.title, "date": _iso(last.date)}
            if data is not None:
                scan = {"virusFound": False, "virusNames": None}
                entry["securityFileStatus"] = {"status": "safe", "avScan": scan, "pickleImportScan": None}
        return entry

    def _sign(self, sha256: str, key: str) -> str:
        with self._lock:
            expires = math.ceil(time.time() + self.url_ttl)
            msg = f"{sha256}:{expires}:{next(self._ids)}".encode()
            sig = hmac.new(self._secret, msg, hashlib.sha256).hexdigest()[:32]
            self._signed[sig] = _Signed(sha256, expires, key)
        return f"{self.cdn}/blobs/{sha256}?expires={expires}&sig={sig}"

    def _check_signed(self, sha256: str, expires: str, sig: str) -> tuple[_Signed | None, str]:
        """The signed URL's record and "", or None and why S3 refuses it."""
        with self._lock:
            signed = self._signed.get(sig)
            if signed is None or signed.sha256 != sha256 or str(signed.expires) != expires:
                return None, "Access denied"
            signed.uses += 1
            used_up = self.url_uses is not None and signed.uses > self.url_uses
            if used_up or signed.revoked or time.time() > signed.expires:
                return None, "Request has expired"
            return signed, ""


def _read_files(files: Files) -> dict[str, bytes]:
    if isinstance(files, Path):
        return {p.relative_to(files).as_posix(): p.read_bytes() for p in sorted(files.rglob("*")) if p.is_file()}
    return {name: data.read_bytes() if isinstance(data, Path) else bytes(data) for name, data in files.items()}


def main(argv: list[str] | None = None) -> None:
    """Serves folders as dataset repos until killed; prints HF_ENDPOINT=… for the shell that started it."""
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.hub", description=main.__doc__)
    parser.add_argument("--repo", action="append", required=True, metavar="ORG/NAME=FOLDER")
    parser.add_argument("--gated", action="store_true", help="every repo is gated")
    parser.add_argument("--token", action="append", default=[], help="a token granted every repo")
    parser.add_argument("--port", type=int, default=0, help="the Hub's port (the CDN's is any free one)")
    args = parser.parse_args(argv)
    hub = Hub(port=args.port)
    for spec in args.repo:
        repo_id, _, folder = spec.partition("=")
        hub.add_repo(repo_id, Path(folder), gated=args.gated)
        for token in args.token:
            hub.grant(token, repo_id)
    with hub:
        print(f"HF_ENDPOINT={hub.endpoint}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
