"""A real ``grserve serve`` process for the tests that kill things: started on a free loopback port with this
source tree first on ``PYTHONPATH`` and the admin key ``adm``; ``serve`` yields it once ``/health`` answers 200 and
always kills it at the end. Its engine-core process is found through ``/health`` (``engine_core_pid``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

SRC = str(Path(__file__).resolve().parents[1] / "src")
ADMIN = {"Authorization": "Bearer adm"}


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def health(self) -> httpx.Response | None:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(self.url + "/health", timeout=5)
        return None

    def post(self, path: str, body: dict, timeout: float = 120) -> dict:
        """POST with the admin key; asserts a 200 and returns its JSON."""
        r = httpx.post(self.url + path, json=body, headers=ADMIN, timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()

    def core_pid(self) -> int:
        return int(self.health().json()["engine_core_pid"])

    def wait_healthy(self, timeout_s: float = 300, unless_pid: int | None = None) -> dict:
        """/health's JSON once it answers 200 (with an engine-core pid other than ``unless_pid``, if given)."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            r = self.health()
            if r is not None and r.status_code == 200:
                h = r.json()
                if unless_pid is None or h.get("engine_core_pid") not in (None, unless_pid):
                    return h
            time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(args: list[str], log_path: Path, port: int | None = None):
    """``python -m grserve serve ARGS --port P`` (a free port unless given); yields a ``Server`` once /health
    answers 200."""
    port = port or free_port()
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "GRSERVE_ADMIN_API_KEY": "adm"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "grserve", "serve", *args, "--port", str(port),
                                 "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        server.wait_healthy()
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
