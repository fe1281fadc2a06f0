"""Loopback stand-ins for the Hugging Face Hub and for a PyPI package index, for tests/test_registry.py.

FakeHub answers what huggingface-hub's hf_hub_download asks (HEAD and GET of /{repo}/resolve/{revision}/{file},
with X-Repo-Commit, ETag/X-Linked-Etag, X-Linked-Size, Content-Length and Range) and can misbehave on purpose.
PackageIndex serves a PEP 503 "simple" index of wheels built by build_wheel(). Both record every request.
"""
from __future__ import annotations

import base64
import hashlib
import os
import shutil
import socket
import threading
import time
import zipfile
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    at: float = field(default_factory=time.monotonic)


class _Server:
    def __init__(self, handler):
        self.requests: list[Request] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclass
class HubFile:
    path: Path             # the bytes served (read from disk in chunks: GGUF files are large)
    sha256: str
    mode: str = "ok"       # ok | wrong (one byte flipped) | drop_once | drop_always | slow | norange (answers a Range
                           # request with the whole file, as some CDNs do) | gate (sends drop_at bytes, then waits for
                           # `release` before the rest: a transfer held midway for as long as a test needs) |
                           # forbidden | unavailable
    drop_at: int = 40 << 20  # where a dropping connection stops (past hf's 10 MB read chunks, so some bytes land)
    dropped: int = 0
    gated: threading.Event = field(default_factory=threading.Event)   # gate: set once drop_at bytes are sent
    release: threading.Event = field(default_factory=threading.Event)  # gate: set by the test to send the rest


class FakeHub(_Server):
    """A Hub with files at /{repo}/resolve/{revision}/{file}; anything else is 404 RepoNotFound."""

    def __init__(self):
        self.files: dict[tuple[str, str], HubFile] = {}
        super().__init__(partial(_HubHandler, self))

    def add(self, repo: str, filename: str, path: Path, sha256: str, mode: str = "ok") -> HubFile:
        self.files[(repo, filename)] = f = HubFile(Path(path), sha256, mode)
        return f

    def gets(self) -> list[Request]:
        return [r for r in self.requests if r.method == "GET"]


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def __init__(self, hub: FakeHub, *args, **kwargs):
        self.hub = hub
        super().__init__(*args, **kwargs)

    def log_message(self, *args) -> None:
        pass

    def handle(self) -> None:
        try:
            super().handle()
        except (BrokenPipeError, ConnectionResetError):  # the client gave up on a dropped transfer
            pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _error(self, code: int, error_code: str) -> None:
        self.send_response(code)
        self.send_header("X-Error-Code", error_code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _serve(self, body: bool) -> None:
        self.hub.requests.append(Request(self.command, self.path, self.headers.get("Range")))
        repo, sep, rest = self.path.partition("/resolve/")
        revision, _, filename = rest.partition("/")
        f = self.hub.files.get((repo.lstrip("/"), filename)) if sep else None
        if f is None:
            return self._error(404, "RepoNotFound")
        if f.mode == "forbidden":
            return self._error(403, "Forbidden")
        if f.mode == "unavailable":
            return self._error(503, "ServiceUnavailable")
        size = f.path.stat().st_size
        start = 0
        if body and self.headers.get("Range") and f.mode != "norange":
            start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0])
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{f.sha256}"')
        self.send_header("X-Linked-Etag", f'"{f.sha256}"')
        self.send_header("X-Linked-Size", str(size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(size - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        self.end_headers()
        if not body:
            return
        stop = size
        if f.mode == "drop_always" or (f.mode == "drop_once" and f.dropped == 0):
            stop = max(start, min(size, f.drop_at))
        with open(f.path, "rb") as src:
            src.seek(start)
            pos = start
            while pos < stop:
                chunk = bytearray(src.read(min(1 << 20, stop - pos)))
                if f.mode == "wrong" and pos <= size // 2 < pos + len(chunk):
                    chunk[size // 2 - pos] ^= 0xFF
                self.wfile.write(chunk)
                pos += len(chunk)
                if f.mode == "slow":  # a slow line: time for a user to press Ctrl-C midway
                    time.sleep(0.02)  # ~2 s for the file: the second pull, started with the first, waits
                if f.mode == "gate" and pos >= min(f.drop_at, size) and not f.release.is_set():
                    self.wfile.flush()
                    f.gated.set()
                    f.release.wait(120)
        if stop < size:  # cut the connection mid-body, as a flaky network would
            f.dropped += 1
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True


class PackageIndex(_Server):
    """A PEP 503 simple index served from a directory: /simple/{project}/ lists /files/{wheel}."""

    def __init__(self, root: Path):
        self.root = root
        (root / "simple").mkdir(parents=True, exist_ok=True)
        (root / "files").mkdir(exist_ok=True)
        index = self

        class Handler(SimpleHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                index.requests.append(Request("GET", self.path, None))
                super().do_GET()

        super().__init__(partial(Handler, directory=str(root)))

    def add(self, wheel: Path) -> None:
        project = wheel.name.split("-")[0].replace("_", "-").lower()
        shutil.copy(wheel, self.root / "files" / wheel.name)
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        page = self.root / "simple" / project / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(f'<!DOCTYPE html><html><body><a href="../../files/{wheel.name}#sha256={digest}">'
                        f"{wheel.name}</a></body></html>")


def build_wheel(out: Path, project: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid py3-none-any wheel holding `files` (archive name -> bytes)."""
    dist = project.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    meta = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: localspec-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    entries = {**files, **meta}
    record = []
    for name, data in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    out.mkdir(parents=True, exist_ok=True)
    wheel = out / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return wheel


def hub_env(tmp: Path, hub_url: str, index_url: str) -> dict[str, str]:
    """Environment for a subprocess that must only ever see the loopback servers and tmp directories.

    The user models file is tmp/models.toml (created empty; tests append to it).
    """
    (tmp / "models.toml").touch()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "HF_", "HUGGINGFACE_", "LOCALSPEC_")) and k != "TRANSFORMERS_OFFLINE"}
    env.update(
        LOCALSPEC_HOME=str(tmp / "home"), HF_HOME=str(tmp / "hf"), HF_ENDPOINT=hub_url,
        HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_XET="1",
        HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5",
        # pip sees only the loopback index: no user/global config (find-links, extra indexes), no cache.
        PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=f"{index_url}/simple/", PIP_NO_CACHE_DIR="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_RETRIES="0", PIP_DEFAULT_TIMEOUT="5",
        LOCALSPEC_MODELS=str(tmp / "models.toml"),
    )
    return env
