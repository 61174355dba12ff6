"""``grserve bench invariance``: does a request's answer depend on what shares its batch? (issue 42's goal)

Starts ``grserve serve MODE`` as a user would (its defaults -- ``--dtype auto``, retrieval batch-invariant -- plus
``--server-flags``; the same server helpers as ``grserve bench soak``), then sends the same ``--requests``
different requests once per entry of ``--concurrency`` (default ``1,16,16``: one at a time, then 16 in flight
twice, so the server batches them with different neighbours in different positions). Every run is compared with
every other, request by request:

- identical lists: the same items in the same order;
- identical scores: the same lists and every score bitwise equal (the JSON numbers parsed to float64 and compared
  as bits; ranking also compares each item's ``logprob``);
- max |Δ score|: over the items both answers hold.

Requests (seeded, ``--seed``; ``grserve bench soak``'s bodies): ``retrieval``: ``POST /v1/recommend`` with
``history_tokens`` of 4-300 random SID tokens, beam width 8 / 32 / 64, ``top_n`` min(``--top-n``, beam width);
``ranking``: ``POST /v1/rank``, a random registered user and 1 to ``--max-candidates`` of the generated catalog's
items (a repeated user is also served from the user-prefix cache: cached vs recomputed is compared too).

Prints a table (one row per pair of runs), the batch sizes each run saw (the responses' ``batch_size``: proof the
server did batch), and one JSON line naming the dtype the server chose (its start line), the quantization,
batch_invariant and the machine. Exits 1 when any pair differs or any request failed.
``--server-flags=--no-batch-invariant`` (with ``=``: the value starts with ``--``) asks whether invariance needed the
flag. ``--url`` checks a server already running (its start line is not seen: dtype null, the precision fields from
``--server-flags`` as given).
"""

from __future__ import annotations

import http.client
import json
import math
import re
import shlex
import struct
import sys
import threading
import time
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from urllib.parse import urlsplit

from grserve.flags import Checked, comma_list, config_command, flag, non_negative, port_number, positive, \
    positive_int, split_commas

MODES = ("retrieval", "ranking")


@dataclass(frozen=True)
class InvarianceBenchConfig(Checked):
    """The knobs of ``grserve bench invariance``."""

    mode: str = flag("retrieval", "which server: grserve serve retrieval | ranking", choices=MODES)
    requests: int = flag(64, "different requests, the same ones in every run", check=positive_int)
    concurrency: str = flag("1,16,16", "one run per entry: requests in flight (each run is compared with every "
                                       "other)", check=comma_list(int, each=positive), metavar="N,N,...")
    top_n: int = flag(20, "retrieval: items per answer (at most the request's beam width)", check=positive_int)
    max_candidates: int = flag(64, "ranking: most candidates of a request", check=positive_int)
    seed: int = flag(0, "seed of the request bodies", check=non_negative)
    server_flags: str = flag("", "extra flags of 'grserve serve MODE', given after '=' (default none: the "
                                 "defaults a user runs), e.g. --server-flags='--no-batch-invariant --dtype "
                                 "float32'", metavar="FLAGS")
    port: int = flag(0, "the server's port (0: a free one)", check=port_number)
    url: str | None = flag(None, "check this running server instead of starting one (http://HOST:PORT)",
                           metavar="URL")
    log: str | None = flag(None, "the server's output (default: invariance-MODE-server.log in the working "
                                 "directory)", metavar="FILE")
    out: str | None = flag(None, "also write the JSON report (every answer included) here", metavar="FILE")
    startup_timeout: float = flag(600.0, "seconds the server may take to start", check=positive)
    progress: bool = flag(True, "a progress bar on stderr")


def add_command(sub) -> None:
    config_command(sub, "invariance", help="batch invariance over HTTP: the same requests at concurrency 1 and 16 "
                                           "give identical lists and bitwise-identical scores (issue 42)",
                   cls=InvarianceBenchConfig, run=run, description=__doc__)


# ---- the requests and their answers -----------------------------------------------------------------------------
def make_bodies(mode: str, facts: dict, n: int, seed: int, top_n: int = 20, max_candidates: int = 64) -> list[dict]:
    """``n`` seeded request bodies (``soak.Bodies``); retrieval answers ``top_n`` items (at most the beam width)."""
    from grserve_bench.soak import Bodies

    gen = Bodies(mode, facts, seed, max_candidates)
    out = []
    for k in range(n):
        body = gen.next()
        if mode == "retrieval":
            body["top_n"] = min(top_n, body["beam_width"])
        body["request_id"] = f"inv-{k}"
        out.append(body)
    return out


def answer_of(mode: str, status: int | str, data: bytes | None) -> dict:
    """A response as compared: ``ids`` (the list, best first), ``scores`` (per item, the numbers compared bitwise:
    retrieval ``[score]``, ranking ``[score, logprob]``), the server's ``batch_size``; ``error`` when it failed."""
    if status != 200 or data is None:
        return {"error": str(status) if data is None else f"HTTP {status}: {data[:200]!r}"}
    r = json.loads(data)
    keys = ("score",) if mode == "retrieval" else ("score", "logprob")
    return {"ids": [it["item_id"] if it.get("item_id") is not None else it.get("index") for it in r["items"]],
            "scores": [[float(it[k]) for k in keys] for it in r["items"]], "batch_size": r.get("batch_size")}


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def compare(a: list[dict], b: list[dict]) -> dict:
    """Request by request: identical lists, bitwise-identical scores (same lists and every number's bits), the
    largest |Δ| over the items both answers hold, and the requests that differ (or failed in either run)."""
    same_list = same_scores = failed = 0
    max_delta, differ = 0.0, []
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        if "error" in x or "error" in y:
            failed += 1
            differ.append(k)
            continue
        lists = x["ids"] == y["ids"]
        same_list += lists
        bitwise = lists and all(_bits(p) == _bits(q) for sx, sy in zip(x["scores"], y["scores"])
                                for p, q in zip(sx, sy, strict=True))
        same_scores += bitwise
        if not bitwise:
            differ.append(k)
        ya = dict(zip(y["ids"], y["scores"]))
        for i, sx in zip(x["ids"], x["scores"]):
            if i in ya:
                for p, q in zip(sx, ya[i]):
                    d = abs(p - q)
                    if not math.isnan(d):
                        max_delta = max(max_delta, d)
    return {"requests": len(a), "identical_lists": same_list, "identical_scores": same_scores,
            "max_abs_delta": max_delta, "failed": failed, "differ": differ}


# ---- sending ---------------------------------------------------------------------------------------------------
def send_all(base: str, mode: str, bodies: list[dict], concurrency: int, tick=lambda: None,
             timeout: float = 600.0) -> list[dict]:
    """Every body once, ``concurrency`` in flight (one keep-alive connection per client thread, all started
    together so the server batches them); the answers in the bodies' order."""
    from grserve_bench.soak import _request

    path = {"retrieval": "/v1/recommend", "ranking": "/v1/rank"}[mode]
    u = urlsplit(base)
    out: list[dict | None] = [None] * len(bodies)
    todo = iter(range(len(bodies)))
    lock, start = threading.Lock(), threading.Barrier(concurrency)

    def client() -> None:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
        start.wait()
        try:
            while True:
                with lock:
                    k = next(todo, None)
                if k is None:
                    return
                try:
                    status, data = _request(conn, "POST", path, bodies[k], timeout=timeout)
                except Exception as exc:  # noqa: BLE001 - recorded as a failed request
                    status, data = type(exc).__name__, None
                    conn.close()
                    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
                out[k] = answer_of(mode, status, data)
                tick()
        finally:
            conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return [x if x is not None else {"error": "not sent"} for x in out]


# ---- what the server runs in -----------------------------------------------------------------------------------
START_LINE = re.compile(r"^grserve: model \S+ \(")
DTYPES = ("float32", "bfloat16", "float16", "float64")


def _label(line: str) -> str:
    """The parenthesised precision of a start line ``grserve: model SOURCE (LABEL)...`` (brackets matched)."""
    start = START_LINE.match(line).end()
    depth = 1
    for i in range(start, len(line)):
        depth += {"(": 1, ")": -1}.get(line[i], 0)
        if depth == 0:
            return line[start:i]
    return line[start:]


def server_precision(log_text: str, server_flags: str, mode: str) -> dict:
    """dtype (as the server's start line names it: ``auto`` resolved), quantization and batch_invariant."""
    words = shlex.split(server_flags)
    line = next((x for x in log_text.splitlines() if START_LINE.match(x)), None)
    label = _label(line) if line else ""
    dtype = next((w for w in re.findall(r"[a-z0-9]+", label.split(",")[0]) if w in DTYPES), None)
    q = re.search(r"quantization (\S+)", label)
    asked_q = next((w.split("=", 1)[1] if "=" in w else words[i + 1] for i, w in enumerate(words)
                    if w.startswith("--quantization") and ("=" in w or i + 1 < len(words))), "none")
    asked_dtype = next((w.split("=", 1)[1] if "=" in w else words[i + 1] for i, w in enumerate(words)
                        if w.startswith("--dtype") and ("=" in w or i + 1 < len(words))), "auto")
    if mode == "retrieval":
        invariant: bool | str = "--no-batch-invariant" not in words
    else:
        invariant = "by construction (BAT; no flag)"
    return {"dtype": dtype, "dtype_asked": asked_dtype, "dtype_label": label or None,
            "quantization": q.group(1).rstrip(";,)") if q else asked_q, "batch_invariant": invariant,
            "start_line": line}


# ---- the command ----------------------------------------------------------------------------------------------
def _print_report(mode: str, runs: list[dict], pairs: list[dict], prec: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"grserve bench invariance ({mode}; dtype {prec['dtype']}, quantization "
                    f"{prec['quantization']}, batch_invariant {prec['batch_invariant']})")
    for col in ("runs compared", "identical lists", "identical scores", "max |Δ score|", "failed"):
        t.add_column(col)
    for p in pairs:
        n = p["requests"]
        t.add_row(p["runs"], f"{p['identical_lists']}/{n}", f"{p['identical_scores']}/{n}",
                  f"{p['max_abs_delta']:.3g}", str(p["failed"]))
    con = Console(file=sys.stdout, width=140)
    con.print(t)
    for r in runs:
        con.print(f"run {r['run']}: concurrency {r['concurrency']}, {r['seconds']:.1f} s, batch sizes the server "
                  f"reported: max {r['batch_max']}, mean {r['batch_mean']}, {r['alone']} of {r['requests']} "
                  f"requests alone in their batch")


def run(cfg: InvarianceBenchConfig) -> int:
    import os
    import signal

    from grserve_bench.machine import machine_info
    from grserve_bench.soak import _free_port, server_facts, start_server, stop_server

    def _terminated(*_):
        raise KeyboardInterrupt  # SIGTERM: stop the server on the way out (the finally below)

    signal.signal(signal.SIGTERM, _terminated)
    levels = [int(c) for c in split_commas(cfg.concurrency)]
    log = Path(cfg.log or f"invariance-{cfg.mode}-server.log").resolve()
    result: dict = {"bench": "invariance", "mode": cfg.mode, "requests": cfg.requests, "concurrency": levels,
                    "server_flags": cfg.server_flags, "seed": cfg.seed,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_before": os.getloadavg()[0]}
    proc = None
    answers: list[list[dict]] = []
    runs: list[dict] = []
    try:
        if cfg.url:
            base = cfg.url.rstrip("/")
            log_text = ""
        else:
            proc, base = start_server("invariance", cfg.mode, cfg.port or _free_port(), cfg.server_flags,
                                      cfg.startup_timeout, log, result)
            log_text = log.read_text(errors="replace")
        result.update(server_precision(log_text, cfg.server_flags, cfg.mode))
        if result["start_line"]:
            print(f"invariance: {result['start_line']}", flush=True)
        facts = server_facts(base, cfg.mode, cfg.server_flags)
        bodies = make_bodies(cfg.mode, facts, cfg.requests, cfg.seed, cfg.top_n, cfg.max_candidates)
        from tqdm import tqdm

        with tqdm(total=len(levels) * len(bodies), desc="invariance", unit="req", file=sys.stderr,
                  disable=not cfg.progress) as bar:
            for k, c in enumerate(levels):
                bar.set_postfix_str(f"run {k + 1}: concurrency {c}")
                t0 = time.perf_counter()
                got = send_all(base, cfg.mode, bodies, c, tick=lambda: bar.update(1))
                sizes = [a["batch_size"] for a in got if a.get("batch_size") is not None]
                answers.append(got)
                runs.append({"run": k + 1, "concurrency": c, "requests": len(got),
                             "seconds": round(time.perf_counter() - t0, 2),
                             "failed": sum("error" in a for a in got), "batch_max": max(sizes, default=None),
                             "batch_mean": round(sum(sizes) / len(sizes), 2) if sizes else None,
                             "alone": sum(s == 1 for s in sizes)})
    finally:
        if proc is not None:
            stop_server(proc)
    pairs = []
    for i, j in combinations(range(len(answers)), 2):
        c = compare(answers[i], answers[j])
        c["runs"] = f"{i + 1} (c{levels[i]}) vs {j + 1} (c{levels[j]})"
        pairs.append(c)
    ok = bool(pairs) and all(p["identical_scores"] == p["requests"] and not p["failed"] for p in pairs)
    result.update({"runs": runs, "pairs": pairs, "invariant": ok, "machine": machine_info(),
                   "load_after": os.getloadavg()[0],
                   "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    _print_report(cfg.mode, runs, pairs, result)
    print(f"invariance: {'PASS' if ok else 'FAIL'}: "
          + "; ".join(f"{p['runs']}: {p['identical_lists']}/{p['requests']} lists, "
                      f"{p['identical_scores']}/{p['requests']} scores" for p in pairs), flush=True)
    if cfg.out:
        Path(cfg.out).write_text(json.dumps({**result, "bodies": bodies, "answers": answers}, indent=1))
    print(json.dumps(result), flush=True)
    return 0 if ok else 1
