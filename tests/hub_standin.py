"""A local stand-in for the few Hugging Face Hub HTTP endpoints an upload uses.

``huggingface_hub`` talks to ``HF_ENDPOINT``; pointing it here exercises the real client
(``create_repo``, ``create_branch``, ``upload_folder``: README validation, preupload,
commit) end to end, with the network as the only boundary replaced. The server answers
every file as a "regular" (inline, base64) upload, which the Hub protocol allows, so no
LFS/Xet storage is needed; it keeps each committed file's bytes and every request, so
tests can check exactly what reached "the Hub".
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Repo:
    private: bool
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    commits: list[dict] = field(default_factory=list)


@dataclass
class HubState:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str, dict]] = field(default_factory=list)  # method, path, headers (lower-case)
    validated_readmes: list[str] = field(default_factory=list)


_REPO = r"/api/models/(?P<repo>[^/]+/[^/]+)"


class _Handler(BaseHTTPRequestHandler):
    state: HubState  # set on the subclass made per server

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def _headers(self) -> dict[str, str]:
        return {key.lower(): value for key, value in self.headers.items()}

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _reply(self, status: int, payload: dict, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _not_found(self, message: str, code: str = "RepoNotFound") -> None:
        self._reply(404, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

    def do_GET(self) -> None:
        self.state.requests.append(("GET", self.path, self._headers()))
        self._not_found(f"no GET route for {self.path}", "EntryNotFound")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        self.state.requests.append(("POST", self.path, self._headers()))
        body = self._body()
        if not self.headers.get("Authorization", "").startswith("Bearer "):
            self._reply(401, {"error": "Invalid credentials in Authorization header"})
            return
        if path == "/api/repos/create":
            return self._create_repo(json.loads(body))
        if path == "/api/validate-yaml":
            self.state.validated_readmes.append(json.loads(body)["content"])
            return self._reply(200, {"errors": [], "warnings": []})
        match = re.fullmatch(_REPO + r"/(?P<kind>branch|preupload|commit)/(?P<rev>[^/]+)", path)
        if match is None:
            return self._not_found(f"no POST route for {path}", "EntryNotFound")
        repo = self.state.repos.get(match["repo"])
        if repo is None:
            return self._not_found(f"Repository {match['repo']} not found")
        revision = match["rev"].replace("%2F", "/")
        if match["kind"] == "branch":
            if revision in repo.branches:
                return self._reply(409, {"error": "Reference already exists"})
            repo.branches[revision] = dict(repo.branches["main"])
            return self._reply(200, {})
        if revision not in repo.branches:
            return self._not_found(f"Invalid rev id: {revision}", "RevisionNotFound")
        if match["kind"] == "preupload":
            files = json.loads(body)["files"]
            return self._reply(
                200,
                {
                    "files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files
                    ]
                },
            )
        return self._commit(match["repo"], repo, revision, body)

    def _create_repo(self, payload: dict) -> None:
        repo_id = f"{payload.get('organization') or 'user'}/{payload['name']}"
        if repo_id in self.state.repos:
            return self._reply(
                409, {"error": "You already created this model repo", "url": self._url(repo_id)}
            )
        self.state.repos[repo_id] = Repo(private=payload.get("visibility") == "private")
        return self._reply(200, {"url": self._url(repo_id), "name": repo_id})

    def _commit(self, repo_id: str, repo: Repo, revision: str, body: bytes) -> None:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        files = {}
        for line in lines:
            if line["key"] == "file":
                value = line["value"]
                assert value.get("encoding") == "base64", value
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] != "header":
                return self._reply(400, {"error": f"stand-in supports inline files only, got {line['key']}"})
        repo.branches[revision].update(files)
        oid = hashlib.sha1(body).hexdigest()
        repo.commits.append({"revision": revision, "summary": header.get("summary"), "files": sorted(files)})
        self._reply(
            200, {"commitUrl": f"{self._url(repo_id)}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}
        )

    def _url(self, repo_id: str) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/{repo_id}"


class HubStandIn:
    """``with HubStandIn() as hub:`` serves on ``hub.endpoint`` from a background thread."""

    def __init__(self) -> None:
        self.state = HubState()
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
