"""A test double of the Hugging Face Hub HTTP API, for the packaging tests. Not the Hub, and no substitute for it.

It answers, on loopback, the subset of the Hub's HTTP API that `huggingface_hub` 2.4 (`HfApi`, `hf_hub_download`,
`snapshot_download`) and `kernels` 0.17 use for kernel repos, so scripts/publish and `get_kernel` can be run end
to end without a network. Repos live in memory with a real commit graph: every commit has a sha, a parent and a
full file tree; branches and tags are refs to commits. Unknown routes answer 404 and are recorded in `unhandled`,
so a test notices when a client starts using an endpoint the double does not know.

Answered (`{type}s` is `kernels`, `models`, `datasets` or `spaces`; `{rev}` a branch, tag or commit sha):

    POST /api/repos/create                        {name, organization, type} -> {url}; 409 if it exists
    POST /api/validate-yaml                       {content, repoType} -> {errors: [], warnings: []}
    POST /api/{type}s/{ns}/{name}/preupload/{rev} {files: [{path, size, sample}]} -> uploadMode "regular" for all,
                                                  with `oid` (git blob id) of the file already at `rev`
    POST /api/{type}s/{ns}/{name}/commit/{rev}    ndjson: header, file (base64), deletedFile, deletedFolder
    POST /api/{type}s/{ns}/{name}/branch/{b}      {startingPoint?}; 409 if it exists
    POST /api/{type}s/{ns}/{name}/tag/{rev}       {tag, message?}; 409 if it exists
    GET  /api/{type}s/{ns}/{name}/refs            {branches, tags, converts, pullRequests}
    GET  /api/{type}s/{ns}/{name}[/revision/{rev}]  {id, author, sha, private, lastModified, siblings}
    GET  /api/{type}s/{ns}/{name}/tree/{rev}[/{path}]?recursive=  [{type: file|directory, path, oid, size}]
    HEAD|GET /{kernels/,datasets/,spaces/,}{ns}/{name}/resolve/{rev}/{path}  X-Repo-Commit, ETag, Content-Length
    GET  /api/organizations/{org}/overview        {name, trustedKernelPublisher}; trusted: `state.trusted_orgs`
    GET  /api/agent-harnesses                     empty registry (huggingface_hub's user-agent telemetry)

Writes need `Authorization: Bearer <token>` with the server's token; reads are anonymous. Everything is
regular (non-LFS, non-Xet) storage, which is what the clients fall back to when the server offers nothing else.

    with HubServer(token="hf_test") as hub:
        os.environ["HF_ENDPOINT"] = hub.url  # in the client process, before huggingface_hub is imported
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from _hub_release import git_blob_id  # scripts/ is on pytest.ini's pythonpath, or the client's PYTHONPATH

REPO_TYPES = {"kernels": "kernel", "models": "model", "datasets": "dataset", "spaces": "space"}
SHA_PATTERN = re.compile(r"[0-9a-f]{40}")
INITIAL_FILES = {".gitattributes": b"*.bin filter=lfs diff=lfs merge=lfs -text\n"}


@dataclass
class Commit:
    sha: str
    parent: str | None
    files: dict[str, bytes]  # full tree at this commit: path -> content
    title: str
    date: str


@dataclass
class Repo:
    repo_type: str  # "kernel", "model", ...
    repo_id: str
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)  # name -> commit sha
    tags: dict[str, str] = field(default_factory=dict)  # name -> commit sha

    def add_commit(self, parent: str | None, files: dict[str, bytes], title: str) -> Commit:
        date = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        digest = hashlib.sha1()
        digest.update(json.dumps([parent, title, date, len(self.commits)]).encode())
        for path in sorted(files):
            digest.update(f"{path}\0{git_blob_id(files[path])}\n".encode())
        commit = Commit(sha=digest.hexdigest(), parent=parent, files=dict(files), title=title, date=date)
        self.commits[commit.sha] = commit
        return commit

    def resolve(self, rev: str) -> Commit | None:
        """Branch, then tag, then full commit sha (the Hub's order)."""
        sha = self.branches.get(rev) or self.tags.get(rev) or (rev if SHA_PATTERN.fullmatch(rev) else None)
        return self.commits.get(sha) if sha else None


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class HubState:
    """All repos and organisations of the double, shared by the handler threads (one lock guards it)."""

    def __init__(self, token: str):
        self.token = token
        self.lock = threading.Lock()
        self.repos: dict[tuple[str, str], Repo] = {}
        self.trusted_orgs: set[str] = set()
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.unhandled: list[tuple[str, str]] = []

    def repo(self, repo_type: str, repo_id: str) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    def writes(self) -> list[tuple[str, str]]:
        return [(m, p) for m, p in self.requests if m not in ("GET", "HEAD")]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, format, *args):  # keep test output quiet
        pass

    # -- plumbing ------------------------------------------------------------------------------------------

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, content_type="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, payload, headers: dict | None = None):
        self._send(status, json.dumps(payload).encode(), headers)

    def _authorize(self):
        if self.headers.get("Authorization") != f"Bearer {self.server.state.token}":
            raise HubError(401, "Invalid credentials in Authorization header")

    def _dispatch(self):
        state = self.server.state
        url = urlsplit(self.path)
        with state.lock:
            state.requests.append((self.command, url.path))
        body = self._body() if self.command in ("POST", "PUT", "DELETE") else b""
        try:
            with state.lock:
                handled = self._route(url.path, parse_qs(url.query), body)
            if not handled:
                with state.lock:
                    state.unhandled.append((self.command, url.path))
                raise HubError(404, f"hub_server: no route for {self.command} {url.path}")
        except HubError as e:
            headers = {"X-Error-Message": e.message, **e.headers}
            if e.code:
                headers["X-Error-Code"] = e.code
            self._json(e.status, {"error": e.message}, headers)

    do_GET = do_HEAD = do_POST = do_DELETE = _dispatch

    # -- routes --------------------------------------------------------------------------------------------

    def _route(self, path: str, query: dict, body: bytes) -> bool:
        # Split before unquoting: revisions and tree paths arrive percent-encoded (a '/' in them is %2F).
        parts = path.strip("/").split("/")
        method = self.command
        if method == "POST" and parts == ["api", "repos", "create"]:
            return self._create_repo(json.loads(body))
        if method == "GET" and parts == ["api", "agent-harnesses"]:
            # huggingface_hub's user-agent telemetry fetches this registry; an empty one detects no agent.
            self._json(200, {"standardEnvVars": [], "harnesses": {}})
            return True
        if method == "POST" and parts == ["api", "validate-yaml"]:
            self._json(200, {"errors": [], "warnings": []})
            return True
        if method == "GET" and len(parts) == 4 and parts[:2] == ["api", "organizations"] and parts[3] == "overview":
            org = unquote(parts[2])
            self._json(200, {"name": org, "fullname": org, "avatarUrl": "",
                             "trustedKernelPublisher": org in self.server.state.trusted_orgs})
            return True
        if len(parts) >= 4 and parts[0] == "api" and parts[1] in REPO_TYPES:
            repo_type, repo_id = REPO_TYPES[parts[1]], f"{unquote(parts[2])}/{unquote(parts[3])}"
            return self._repo_api(method, repo_type, repo_id, parts[4:], query, body)
        if method in ("GET", "HEAD"):
            repo_type = "model"
            if parts and parts[0] in REPO_TYPES and parts[0] != "models":
                repo_type, parts = REPO_TYPES[parts[0]], parts[1:]
            if len(parts) >= 5 and parts[2] == "resolve":
                repo_id = f"{unquote(parts[0])}/{unquote(parts[1])}"
                return self._resolve(repo_type, repo_id, unquote(parts[3]), unquote("/".join(parts[4:])))
        return False

    def _create_repo(self, payload: dict) -> bool:
        self._authorize()
        state = self.server.state
        repo_type = payload.get("type") or "model"
        repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        answer = {"url": f"{self.server.url}/{prefix}{repo_id}", "name": repo_id}
        if (repo_type, repo_id) in state.repos:
            # The Hub's 409 carries the url too; `create_repo(exist_ok=True)` reads it.
            self._json(409, {"error": "You already created this repo", **answer},
                       {"X-Error-Message": "You already created this repo"})
            return True
        repo = Repo(repo_type=repo_type, repo_id=repo_id)
        repo.branches["main"] = repo.add_commit(None, INITIAL_FILES, "initial commit").sha
        state.repos[(repo_type, repo_id)] = repo
        self._json(200, answer)
        return True

    def _repo_api(self, method, repo_type, repo_id, rest, query, body) -> bool:
        repo = self.server.state.repo(repo_type, repo_id)
        action = rest[0] if rest else None
        if method == "GET" and action is None:
            return self._info(repo, "main")
        if method == "GET" and action == "revision" and len(rest) == 2:
            return self._info(repo, unquote(rest[1]))
        if method == "GET" and action == "refs":
            def ref(kind, name, sha):
                return {"name": name, "ref": f"refs/{kind}/{name}", "targetCommit": sha}

            self._json(200, {
                "branches": [ref("heads", n, s) for n, s in sorted(repo.branches.items())],
                "tags": [ref("tags", n, s) for n, s in sorted(repo.tags.items())],
                "converts": [],
                "pullRequests": [],
            })
            return True
        if method == "GET" and action == "tree" and len(rest) >= 2:
            recursive = query.get("recursive", ["False"])[0].lower() in ("1", "true")
            return self._tree(repo, unquote(rest[1]), unquote("/".join(rest[2:])).strip("/"), recursive)
        if method == "POST" and action == "preupload" and len(rest) == 2:
            self._authorize()
            commit = self._commit_or_404(repo, unquote(rest[1]))
            files = json.loads(body)["files"]
            self._json(200, {"files": [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                 "oid": git_blob_id(commit.files[f["path"]]) if f["path"] in commit.files else None}
                for f in files
            ]})
            return True
        if method == "POST" and action == "commit" and len(rest) == 2:
            self._authorize()
            return self._commit(repo, unquote(rest[1]), body)
        if method == "POST" and action == "branch" and len(rest) == 2:
            self._authorize()
            name = unquote(rest[1])
            start = (json.loads(body) if body else {}).get("startingPoint") or "main"
            if name in repo.branches:
                raise HubError(409, f"Branch {name} already exists")
            repo.branches[name] = self._commit_or_404(repo, start).sha
            self._json(200, {})
            return True
        if method == "POST" and action == "tag" and len(rest) == 2:
            self._authorize()
            name = json.loads(body)["tag"]
            if name in repo.tags:
                raise HubError(409, f"Tag {name} already exists")
            repo.tags[name] = self._commit_or_404(repo, unquote(rest[1])).sha
            self._json(200, {})
            return True
        return False

    def _commit_or_404(self, repo: Repo, rev: str) -> Commit:
        commit = repo.resolve(rev)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return commit

    def _info(self, repo: Repo, rev: str) -> bool:
        commit = self._commit_or_404(repo, rev)
        self._json(200, {
            "id": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": commit.sha,
            "private": False,
            "lastModified": commit.date,
            "siblings": [{"rfilename": path} for path in sorted(commit.files)],
        })
        return True

    def _tree(self, repo: Repo, rev: str, prefix: str, recursive: bool) -> bool:
        commit = self._commit_or_404(repo, rev)
        base = f"{prefix}/" if prefix else ""
        below = {path: content for path, content in commit.files.items() if path.startswith(base)}
        if prefix and not below:
            raise HubError(404, f"{prefix} does not exist on {rev}", "EntryNotFound")
        entries: dict[str, dict] = {}
        for path, content in sorted(below.items()):
            rel_parts = path[len(base):].split("/")
            # Every folder between `prefix` and the file (only the first level unless recursive).
            for depth in range(1, len(rel_parts) if recursive else min(len(rel_parts), 2)):
                folder = base + "/".join(rel_parts[:depth])
                entries.setdefault(folder, {"type": "directory", "path": folder,
                                            "oid": hashlib.sha1(folder.encode()).hexdigest()})
            if recursive or len(rel_parts) == 1:
                entries[path] = {"type": "file", "path": path, "oid": git_blob_id(content), "size": len(content)}
        self._json(200, list(entries.values()))
        return True

    def _commit(self, repo: Repo, rev: str, body: bytes) -> bool:
        if rev not in repo.branches:
            raise HubError(404, f"Invalid rev id: {rev} is not a branch", "RevisionNotFound")
        head = repo.commits[repo.branches[rev]]
        files = dict(head.files)
        title = "Upload"
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                title = value.get("summary") or title
                parent = value.get("parentCommit")
                if parent and not head.sha.startswith(parent):
                    raise HubError(412, f"parentCommit {parent} is not the head of {rev} ({head.sha})")
            elif key == "file":
                if value.get("encoding") != "base64":
                    raise HubError(400, "hub_server only takes base64 file content")
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                if value["path"] not in files:
                    raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
                del files[value["path"]]
            elif key == "deletedFolder":
                folder = value["path"].rstrip("/") + "/"
                files = {p: c for p, c in files.items() if not p.startswith(folder)}
            else:
                raise HubError(400, f"hub_server does not support commit operation {key!r} (LFS / copies)")
        commit = repo.add_commit(head.sha, files, title)
        repo.branches[rev] = commit.sha
        prefix = "" if repo.repo_type == "model" else f"{repo.repo_type}s/"
        self._json(200, {"commitUrl": f"{self.server.url}/{prefix}{repo.repo_id}/commit/{commit.sha}",
                         "commitOid": commit.sha, "pullRequestUrl": None})
        return True

    def _resolve(self, repo_type: str, repo_id: str, rev: str, path: str) -> bool:
        repo = self.server.state.repo(repo_type, repo_id)
        commit = self._commit_or_404(repo, rev)
        if path not in commit.files:
            raise HubError(404, f"{path} does not exist on {rev}", "EntryNotFound", {"X-Repo-Commit": commit.sha})
        content = commit.files[path]
        self._send(200, content, {"X-Repo-Commit": commit.sha, "ETag": f'"{git_blob_id(content)}"'},
                   content_type="application/octet-stream")
        return True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: HubState
    url: str


class HubServer:
    """Runs the double on 127.0.0.1 (a free port) in a daemon thread; use as a context manager."""

    def __init__(self, token: str = "hf_test_token"):
        self.state = HubState(token)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "server not started"
        return self._server.url

    def start(self) -> "HubServer":
        server = _Server(("127.0.0.1", 0), _Handler)
        server.state = self.state
        server.url = f"http://127.0.0.1:{server.server_address[1]}"
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="hub_server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
