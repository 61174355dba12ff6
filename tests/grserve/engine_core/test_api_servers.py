"""``grserve serve llm --api-servers 2``: two HTTP front-end processes on one port over one engine process; both
take connections, answers are the same whichever answers, and SIGTERM ends every process of the server."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from grserve.engine_core.client import pid_alive


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str) -> None:
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    raise AssertionError("the server never became healthy")


def test_two_front_ends_one_engine(tmp_path):
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "grserve", "serve", "llm", "--port", str(port), "--api-servers",
                             "2", "--num-blocks", "256", "--threads", "1", "--tokenizer-cache", str(tmp_path),
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url)
        front_ends, cores = set(), set()
        for _ in range(60):  # a new connection each: the kernel hands them to either front end
            h = httpx.get(url + "/health", timeout=10).json()
            front_ends.add(h["front_end_pid"])
            cores.add(h["engine_core_pid"])
        assert len(front_ends) == 2 and len(cores) == 1

        def complete(i: int) -> str:
            r = httpx.post(url + "/v1/completions", json={"model": "tiny-mha", "prompt": f"hello {i % 3}",
                                                          "max_tokens": 6, "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(12) as pool:
            texts = list(pool.map(complete, range(24)))
        for i, t in enumerate(texts):
            assert t == texts[i % 3]  # the same greedy answer through either front end
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        time.sleep(1)
        assert not any(pid_alive(p) for p in front_ends | cores)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_sigterm_drains_the_engine_process_then_stops_it(tmp_path):
    """SIGTERM while a request runs: it finishes (the front end drains the engine process), then both exit."""
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "grserve", "serve", "llm", "--port", str(port), "--num-blocks",
                             "256", "--threads", "1", "--tokenizer-cache", str(tmp_path), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url)
        core = httpx.get(url + "/health").json()["engine_core_pid"]
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(httpx.post, url + "/v1/completions",
                              json={"model": "tiny-mha", "prompt": "hi", "max_tokens": 400, "temperature": 0,
                                    "ignore_eos": True}, timeout=120)
            time.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
            r = fut.result()
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 400
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled once shut down
        time.sleep(0.5)
        assert not pid_alive(core)
        out = proc.stdout.read()  # no noise at shutdown (issue 44): no leak report, no death taken for a crash
        assert not any(word in out for word in ("nanobind", "leaked", "died", "Traceback")), out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
