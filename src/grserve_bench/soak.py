"""``grserve bench soak``: does memory stay flat? One server under closed-loop load for ``--minutes`` (issue 41).

Starts ``grserve serve MODE`` (its own defaults plus ``--server-flags``; its own session, so every process it
starts -- the HTTP front end, the engine-core process, multiprocessing's resource tracker -- is found by session
id), drives it with ``--clients`` closed-loop clients (each sends its next request when the last one answered) and
every ``--sample-s`` seconds reads the RSS (and its anonymous part) of every process of the server from ``/proc``.

Requests, seeded (``--seed``), shapes varying on purpose (an allocator that keeps freed blocks of every shape shows
up as growth):

- ``retrieval``: ``POST /v1/recommend``, ``history_tokens`` of 4-300 random SID tokens, beam width 8 / 32 / 64.
- ``ranking``: ``POST /v1/rank``, a random registered user and 1-``--max-candidates`` distinct random registered
  items (the server's generated catalog: ``--num-items`` / ``--num-users`` as passed to it, else its defaults).
- ``llm``: ``POST /v1/completions``, 4-512 random prompt token ids, 1-128 output tokens (``ignore_eos``), greedy or
  sampled.

Progress: one line per sample (RSS of each process, requests, failures, p50/p99 since the last line). The report:
per-window (``--window-s``) p50/p99 and request counts, failures by HTTP status (or exception), every process's RSS
over time, and the verdict against the issue's goals:

- RSS growth < 10 % for every process from the end of the warm-up (5 minutes; ``minutes / 6`` for a run shorter
  than half an hour) to the end of the run;
- the p99 of the last comparison window (10 minutes; ``minutes / 6`` when shorter than an hour) within 1.2x the
  p99 of the first one, which starts when the warm-up ends;
- 0 failed requests.

The last line is one JSON object (also written to ``--out``). ``--url`` soaks a server that is already running
(its processes are found from ``/health``'s ``front_end_pid`` / ``engine_core_pid``).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from grserve.flags import Checked, UsageError, config_command, flag, non_negative, port_number, positive, \
    positive_int

MODES = ("retrieval", "ranking", "llm")
RSS_GROWTH_LIMIT = 0.10
P99_DRIFT_LIMIT = 1.2


@dataclass(frozen=True)
class SoakBenchConfig(Checked):
    """The knobs of ``grserve bench soak``."""

    mode: str = flag("retrieval", "which server: grserve serve retrieval | ranking | llm tiny", choices=MODES)
    minutes: float = flag(60.0, "how long the load runs", check=positive)
    clients: int = flag(4, "closed-loop clients (requests in flight)", check=positive_int)
    port: int = flag(0, "the server's port (0: a free one)", check=port_number)
    server_flags: str = flag("", "extra flags of 'grserve serve MODE' (default none: the defaults a user runs)",
                             metavar="FLAGS")
    url: str | None = flag(None, "soak this running server instead of starting one (http://127.0.0.1:PORT)",
                           metavar="URL")
    sample_s: float = flag(10.0, "seconds between RSS samples (and progress lines)", check=positive)
    window_s: float = flag(60.0, "seconds per latency window of the report", check=positive)
    warmup_minutes: float | None = flag(None, "RSS growth is measured from here (default: 5, or minutes / 6 for a "
                                              "run shorter than 30 minutes)", check=non_negative)
    compare_minutes: float | None = flag(None, "the p99 windows compared (default: 10, or minutes / 6 for a run "
                                               "shorter than an hour)", check=positive)
    max_candidates: int = flag(128, "ranking: most candidates of a request", check=positive_int)
    seed: int = flag(0, "seed of the request bodies", check=non_negative)
    out: str | None = flag(None, "also write the JSON report here", metavar="FILE")
    log: str | None = flag(None, "the server's output (default: soak-MODE-server.log in the working directory)",
                           metavar="FILE")
    startup_timeout: float = flag(600.0, "seconds the server may take to start", check=positive)


def add_command(sub) -> None:
    config_command(sub, "soak", help="memory and latency under hours of load: RSS of every server process, p99 "
                                     "drift, failures (issue 41)",
                   cls=SoakBenchConfig, run=run, description=__doc__)


# ---- the server's processes and their memory ------------------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes whose session id is ``sid``."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            f = _stat(int(name))
            if f is not None and f[0] != "Z" and int(f[3]) == sid:
                out.append(int(name))
    return sorted(out)


def tree_pids(root: int) -> list[int]:
    """``root`` and all its live descendants."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            f = _stat(int(name))
            if f is not None and f[0] != "Z":
                children.setdefault(int(f[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        if _stat(p) is not None:
            out.append(p)
            todo.extend(children.get(p, []))
    return sorted(out)


def memory_kib(pid: int) -> dict[str, int] | None:
    """VmRSS and RssAnon (KiB) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            out[key] = int(value.split()[0])
    return out if "VmRSS" in out else None


def process_role(pid: int, root: int, known: dict[int, str] | None = None) -> str:
    """A process's name in the report: front-end (the server's first process), engine-core (a multiprocessing
    spawn child), resource-tracker, or its command name."""
    if known and pid in known:
        return known[pid]
    if pid == root:
        return "front-end"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmd = ""
    if "resource_tracker" in cmd:
        return "resource-tracker"
    if "spawn_main" in cmd:
        return "engine-core"
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


class RssSampler:
    """RSS of a server's processes over time: ``sample(t)`` records every live process (new ones included, e.g. an
    engine core after a restart), keyed ``role:pid``."""

    def __init__(self, pids, root: int, known: dict[int, str] | None = None):
        self.pids, self.root, self.known = pids, root, known
        self.series: dict[str, list[tuple[float, float, float]]] = {}  # key -> [(t, rss MiB, anon MiB)]

    def sample(self, t: float) -> dict[str, float]:
        now = {}
        for pid in self.pids():
            m = memory_kib(pid)
            if m is None:
                continue
            key = f"{process_role(pid, self.root, self.known)}:{pid}"
            rss, anon = m["VmRSS"] / 1024, m.get("RssAnon", 0) / 1024
            self.series.setdefault(key, []).append((round(t, 1), round(rss, 1), round(anon, 1)))
            now[key] = rss
        return now


# ---- the verdict ------------------------------------------------------------------------------------------------
def default_windows(minutes: float) -> tuple[float, float]:
    """(warm-up, comparison window) in minutes: 5 and 10 for an hour, scaled to ``minutes / 6`` below."""
    return (5.0 if minutes >= 30 else minutes / 6), (10.0 if minutes >= 60 else minutes / 6)


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s) - 1e-9) - 1))]


def rss_growth(series: dict[str, list[tuple[float, float, float]]], from_s: float, end_s: float) -> dict[str, dict]:
    """Per process: RSS at the first sample at or after ``from_s``, at the last sample, the peak after ``from_s``,
    and the growth; a process that ended more than one sample gap before ``end_s`` is marked ``gone``."""
    out = {}
    for key, pts in series.items():
        after = [p for p in pts if p[0] >= from_s]
        if not after:
            out[key] = {"note": "no sample after the warm-up", "first_s": pts[0][0], "last_s": pts[-1][0]}
            continue
        start, last = after[0], after[-1]
        gap = (pts[-1][0] - pts[0][0]) / max(1, len(pts) - 1) if len(pts) > 1 else 0.0
        out[key] = {"at_s": start[0], "rss_start_mib": start[1], "rss_end_mib": last[1], "end_s": last[0],
                    "rss_peak_mib": max(p[1] for p in after), "anon_start_mib": start[2], "anon_end_mib": last[2],
                    "growth": round(last[1] / start[1] - 1, 4) if start[1] else None,
                    "gone": last[0] < end_s - 2 * gap - 1}
    return out


def verdict(requests: list[tuple[float, float, int | str]], series: dict, minutes: float, warmup_min: float,
            compare_min: float) -> dict:
    """The goals of issue 41 on one run: ``requests`` are (end time s, latency s, status), ``series`` the RSS
    samples (``RssSampler.series``)."""
    end_s = minutes * 60
    w0, cw = warmup_min * 60, compare_min * 60
    ok_lat = [(t, lat) for t, lat, st in requests if st == 200]
    first = [lat for t, lat in ok_lat if w0 <= t < w0 + cw]
    last = [lat for t, lat in ok_lat if end_s - cw <= t <= end_s + 60]
    p99_first, p99_last = percentile(first, 99), percentile(last, 99)
    drift = p99_last / p99_first if p99_first and p99_last else None
    growth = rss_growth(series, w0, end_s)
    failed: dict[str, int] = {}
    for _, _, st in requests:
        if st != 200:
            failed[str(st)] = failed.get(str(st), 0) + 1
    worst = max((g["growth"] for g in growth.values() if g.get("growth") is not None), default=None)
    gone = sorted(k for k, g in growth.items() if g.get("gone"))
    checks = {
        "rss_growth_below_10pct": worst is not None and worst < RSS_GROWTH_LIMIT and not gone,
        "p99_last_within_1_2x_first": drift is not None and drift <= P99_DRIFT_LIMIT,
        "no_failures": not failed,
    }
    return {"pass": all(checks.values()), "checks": checks, "warmup_min": round(warmup_min, 3),
            "compare_min": round(compare_min, 3), "worst_rss_growth": worst, "processes_gone": gone,
            "rss": growth, "p99_first_ms": _ms(p99_first), "p99_last_ms": _ms(p99_last),
            "p50_first_ms": _ms(percentile(first, 50)), "p50_last_ms": _ms(percentile(last, 50)),
            "p99_drift": round(drift, 3) if drift else None, "requests_first": len(first),
            "requests_last": len(last), "failed": failed, "requests": len(requests)}


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1e3 * x, 2)


def windows(requests: list[tuple[float, float, int | str]], window_s: float, end_s: float) -> list[dict]:
    """Per window of ``window_s``: requests, failures, p50/p99 of the successful ones."""
    out = []
    n = max(1, int(-(-end_s // window_s)))
    for k in range(n):
        lo, hi = k * window_s, (k + 1) * window_s
        inside = [(lat, st) for t, lat, st in requests if lo <= t < hi or (k == n - 1 and t >= hi)]
        ok = [lat for lat, st in inside if st == 200]
        out.append({"from_s": lo, "requests": len(inside), "failed": len(inside) - len(ok),
                    "p50_ms": _ms(percentile(ok, 50)), "p99_ms": _ms(percentile(ok, 99))})
    return out


# ---- the load ---------------------------------------------------------------------------------------------------
class Bodies:
    """Seeded random request bodies of one mode; ``facts``: the server's /health (vocabulary, catalog) and
    /v1/models answers."""

    def __init__(self, mode: str, facts: dict, seed: int, max_candidates: int = 128):
        self.mode, self.facts, self.rng = mode, facts, random.Random(seed)
        self.max_candidates = max_candidates

    def path(self) -> str:
        return {"retrieval": "/v1/recommend", "ranking": "/v1/rank", "llm": "/v1/completions"}[self.mode]

    def next(self) -> dict:
        r = self.rng
        if self.mode == "retrieval":
            cat = self.facts.get("catalog") or {}
            sid_tokens = sum(cat.get("codebook_sizes") or [768])
            lo = 16
            hi = min(self.facts.get("vocab_size", lo + sid_tokens), lo + sid_tokens)
            bw = r.choice((8, 32, 64))
            return {"history_tokens": [r.randrange(lo, hi) for _ in range(r.randint(4, 300))], "beam_width": bw,
                    "top_n": min(10, bw)}
        if self.mode == "ranking":
            users, items = self.facts["num_users"], self.facts["num_items"]
            k = r.randint(1, min(self.max_candidates, items))
            return {"user_id": r.randrange(users), "candidates": r.sample(range(items), k), "top_k": min(10, k)}
        vocab = self.facts.get("vocab_size", 32000)
        return {"model": self.facts["model"], "prompt": [r.randrange(300, vocab - 1) for _ in range(r.randint(4, 512))],
                "max_tokens": r.randint(1, 128), "ignore_eos": True, "temperature": r.choice((0.0, 1.0)),
                "seed": r.randrange(1 << 30)}


def _request(conn: http.client.HTTPConnection, method: str, path: str, body: dict | None = None,
             timeout: float = 300.0) -> tuple[int, bytes]:
    conn.timeout = timeout
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, data, {"Content-Type": "application/json"} if data else {})
    r = conn.getresponse()
    return r.status, r.read()


def get_json(base: str, path: str) -> dict:
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        status, data = _request(conn, "GET", path, timeout=10)
    finally:
        conn.close()
    if status != 200:
        raise RuntimeError(f"GET {path}: HTTP {status}: {data[:200]!r}")
    return json.loads(data)


class Load:
    """``clients`` closed-loop threads, each with its own keep-alive connection and its own seeded bodies; every
    request is recorded as (end time since ``t0``, latency, HTTP status or exception name)."""

    def __init__(self, base: str, mode: str, facts: dict, clients: int, seed: int, max_candidates: int = 128):
        self.base, self.t0 = urlsplit(base), time.monotonic()
        self.bodies = [Bodies(mode, facts, seed * 1000 + c, max_candidates) for c in range(clients)]
        self.records: list[tuple[float, float, int | str]] = []
        self.lock, self.stop_at = threading.Lock(), float("inf")
        self.threads = [threading.Thread(target=self._client, args=(b,), daemon=True) for b in self.bodies]

    def start(self, seconds: float) -> None:
        self.t0 = time.monotonic()
        self.stop_at = self.t0 + seconds
        for th in self.threads:
            th.start()

    def join(self) -> None:
        for th in self.threads:
            th.join()

    def _client(self, bodies: Bodies) -> None:
        conn = http.client.HTTPConnection(self.base.hostname, self.base.port)
        path = bodies.path()
        while time.monotonic() < self.stop_at:
            body = bodies.next()
            t = time.monotonic()
            try:
                status, _ = _request(conn, "POST", path, body)
            except Exception as exc:  # noqa: BLE001 - a failure is counted, the client goes on
                status = type(exc).__name__
                conn.close()
                conn = http.client.HTTPConnection(self.base.hostname, self.base.port)
                time.sleep(0.5)
            end = time.monotonic()
            with self.lock:
                self.records.append((end - self.t0, end - t, status))
        conn.close()

    def snapshot(self) -> list[tuple[float, float, int | str]]:
        with self.lock:
            return list(self.records)


# ---- the server ---------------------------------------------------------------------------------------------------
def server_command(mode: str, port: int, flags: str) -> list[str]:
    cmd = [sys.executable, "-m", "grserve", "serve"]
    cmd += {"retrieval": ["retrieval"], "ranking": ["ranking"], "llm": ["llm", "tiny"]}[mode]
    return [*cmd, "--port", str(port), *shlex.split(flags)]


def _flag_value(flags: str, name: str, default: int) -> int:
    words = shlex.split(flags)
    for i, w in enumerate(words):
        if w == name and i + 1 < len(words):
            return int(words[i + 1])
        if w.startswith(name + "="):
            return int(w.split("=", 1)[1])
    return default


def server_facts(base: str, mode: str, flags: str) -> dict:
    facts = get_json(base, "/health")
    if mode == "llm":
        facts["model"] = get_json(base, "/v1/models")["data"][0]["id"]
    if mode == "ranking":  # the generated catalog's sizes: the server's flags, else its defaults
        from grserve.config import RankingDataConfig
        d = RankingDataConfig()
        facts["num_users"] = _flag_value(flags, "--num-users", d.num_users)
        facts["num_items"] = _flag_value(flags, "--num-items", d.num_items)
    return facts


def wait_ready(base: str, proc: subprocess.Popen | None, timeout_s: float, log: Path | None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
        try:
            get_json(base, "/health")
            return
        except (OSError, RuntimeError, http.client.HTTPException):
            time.sleep(1)
    raise RuntimeError(f"the server did not answer /health in {timeout_s:g} s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it drains and stops its core; not SIGINT, which a shell's
    background job -- nohup ... & -- ignores, and its children with it), SIGKILL after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 30
    while session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)


def start_server(name: str, mode: str, port: int, flags: str, startup_timeout: float, log: Path,
                 result: dict) -> tuple[subprocess.Popen, str]:
    """``grserve serve`` of ``mode`` on 127.0.0.1:``port`` with ``flags``, its output in ``log``, waited for until
    ready (a server that never gets ready is stopped); the command goes into ``result["server_command"]``. Returns
    the process and the base URL."""
    base = f"http://127.0.0.1:{port}"
    cmd = server_command(mode, port, flags)
    result["server_command"] = shlex.join(cmd[1:])
    print(f"{name}: starting {shlex.join(cmd)} (log {log})", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(base, proc, startup_timeout, log)
    except BaseException:  # never ready (or interrupted): no server is left behind
        stop_server(proc)
        raise
    return proc, base


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the command ----------------------------------------------------------------------------------------------------
def soak(cfg: SoakBenchConfig, base: str, root: int, pids, known: dict[int, str] | None) -> dict:
    warmup, compare = default_windows(cfg.minutes)
    warmup = cfg.warmup_minutes if cfg.warmup_minutes is not None else warmup
    compare = cfg.compare_minutes if cfg.compare_minutes is not None else compare
    facts = server_facts(base, cfg.mode, cfg.server_flags)
    sampler = RssSampler(pids, root, known)
    load = Load(base, cfg.mode, facts, cfg.clients, cfg.seed, cfg.max_candidates)
    seconds = cfg.minutes * 60
    loads: list[tuple[float, float]] = []
    load.start(seconds)
    sampler.sample(0.0)
    loads.append((0.0, os.getloadavg()[0]))
    seen = 0
    while True:
        now = time.monotonic() - load.t0
        nxt = min(seconds, (int(now // cfg.sample_s) + 1) * cfg.sample_s)
        time.sleep(max(0.0, nxt - now))
        t = time.monotonic() - load.t0
        rss = sampler.sample(t)
        loads.append((round(t, 1), os.getloadavg()[0]))
        recs = load.snapshot()
        new = recs[seen:]
        seen = len(recs)
        ok = [lat for _, lat, st in new if st == 200]
        fails = sum(1 for r in recs if r[2] != 200)
        mem = " ".join(f"{k.split(':')[0]} {v:,.0f}" for k, v in sorted(rss.items()))
        p50, p99 = _ms(percentile(ok, 50)), _ms(percentile(ok, 99))
        print(f"soak {cfg.mode} {t / 60:5.1f} min: RSS MiB {mem} | {len(recs)} requests, {fails} failed | "
              f"last {len(new)}: p50 {p50} ms, p99 {p99} ms | load {loads[-1][1]:.2f}", flush=True)
        if t >= seconds - 0.05:
            break
    load.join()
    end_rss = sampler.sample(time.monotonic() - load.t0)
    del end_rss
    recs = load.snapshot()
    v = verdict(recs, sampler.series, cfg.minutes, warmup, compare)
    return {"verdict": v, "windows": windows(recs, cfg.window_s, seconds), "rss_series": sampler.series,
            "load": {"mean": round(sum(x for _, x in loads) / len(loads), 2), "max": round(max(x for _, x in loads), 2),
                     "series": loads[:: max(1, len(loads) // 120)]},
            "throughput_req_s": round(len(recs) / seconds, 2)}


def run(cfg: SoakBenchConfig) -> int:
    from grserve_bench.machine import machine_info

    def _terminated(*_):
        raise KeyboardInterrupt  # SIGTERM: stop the server on the way out (the finally below)

    signal.signal(signal.SIGTERM, _terminated)
    proc = None
    log = Path(cfg.log or f"soak-{cfg.mode}-server.log").resolve()
    result: dict = {"bench": "soak", "mode": cfg.mode, "minutes": cfg.minutes, "clients": cfg.clients,
                    "server_flags": cfg.server_flags, "seed": cfg.seed, "cpus": os.cpu_count(),
                    "machine": machine_info(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        if cfg.url:
            base = cfg.url.rstrip("/")
            if urlsplit(base).hostname not in ("127.0.0.1", "localhost", "::1"):
                raise UsageError("url", "the soak reads /proc: the server must run on this machine")
            health = get_json(base, "/health")
            root = int(health["front_end_pid"])
            known = {root: "front-end"}
            if health.get("engine_core_pid"):
                known[int(health["engine_core_pid"])] = "engine-core"

            def pids():
                return tree_pids(root)
        else:
            proc, base = start_server("soak", cfg.mode, cfg.port or _free_port(), cfg.server_flags,
                                      cfg.startup_timeout, log, result)
            root, known = proc.pid, None

            def pids():
                return session_pids(root)
        result.update(soak(cfg, base, root, pids, known))
    finally:
        if proc is not None:
            stop_server(proc)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    v = result["verdict"]
    for key, g in sorted(v["rss"].items()):
        if "growth" in g:
            print(f"soak: {key}: RSS {g['rss_start_mib']:,.0f} MiB at {g['at_s'] / 60:.1f} min -> "
                  f"{g['rss_end_mib']:,.0f} MiB at {g['end_s'] / 60:.1f} min ({100 * g['growth']:+.1f} %), "
                  f"peak {g['rss_peak_mib']:,.0f}", flush=True)
    print(f"soak: p99 {v['p99_first_ms']} ms (first {v['compare_min']:.1f} min after the warm-up) -> "
          f"{v['p99_last_ms']} ms (last): x{v['p99_drift']}; p50 {v['p50_first_ms']} -> {v['p50_last_ms']} ms; "
          f"{v['requests']} requests, failed {v['failed'] or 0}; load mean {result['load']['mean']}", flush=True)
    print(f"soak: {'PASS' if v['pass'] else 'FAIL'} {v['checks']}", flush=True)
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("rss_series", "windows")}), flush=True)
    return 0 if v["pass"] else 1
