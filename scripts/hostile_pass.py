"""A hostile pass against a running grserve server (issue 25 "Hardening II"; not part of the package).

    python scripts/hostile_pass.py --url http://127.0.0.1:18101 --server llm            # every phase but sigterm
    python scripts/hostile_pass.py --url ... --server retrieval --phases sigterm --pid PID  # SIGTERM under load

Phases: ``fuzz`` (type-valid absurd values, a few fields of a valid request at a time, seeded), ``big`` (20 MB
body; 7.8 MB prompts / 1M-entry lists while /health is polled), ``burst`` (300 at once), ``disconnect`` (clients
that leave mid-request; the server must be idle and serving after), ``sigterm`` (SIGTERM to --pid during load).
/health is polled every 50 ms throughout, from a process of its own. Reported per phase: requests, status
histogram, 5xx, answers later than 5 s, 200s that carry an error or a truncated result, 429s without Retry-After,
/health's slowest answer (``--log FILE``: every request). Start the server with a small ``--max-waiting`` (e.g. 16)
so the burst goes past capacity. Results of 2026-11-26: docs/security.md, "Hostile pass".
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import random
import signal
import time

import httpx

INTS = [0, -1, 1, 2, 7, 255, 4096, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 10**30, -(10**30)]
FLOATS = [0.0, -0.0, 1e-300, 5e-324, 0.5, 1.0, 2.0, 100.0, -100.0, 1e308, -1e308, 3.4e38]
STRS = ["", " ", "\x00", "\u202e", "a" * 70000, "\U0001F600" * 1000, "\ud800", "\u2028", "<|sid_begin|>", "tiny",
        "\\u0000", "null", "</s>" * 500]


def absurd(rng: random.Random, kind: str):
    """A value of the field's JSON type, chosen to be absurd."""
    if kind == "int":
        return rng.choice(INTS)
    if kind == "float":
        return rng.choice(FLOATS + INTS[:8])
    if kind == "bool":
        return rng.choice([True, False])
    if kind == "str":
        return rng.choice(STRS)
    if kind == "ints":
        return rng.choice([[], [rng.choice(INTS)], [0] * 50000, [rng.choice(INTS) for _ in range(20)],
                           list(range(3000)), [2**63 - 1] * 100])
    if kind == "intss":
        return rng.choice([[], [[]], [[0]], [[1, 2, 3]] * 5000, [[rng.choice(INTS)] * 3],
                           [[0, 0, 0, 0, 0, 0, 0, 0, 0]]])
    if kind == "strs":
        return rng.choice([[], [""], ["a"] * 5, [rng.choice(STRS)], ["x"] * 10000])
    if kind == "dict":
        return rng.choice([{}, {"": ""}, {"1": 1e308}, {str(2**64): 1}, {"0": 100}, {"a" * 1000: "b"}])
    raise ValueError(kind)


LLM_FIELDS = {"max_tokens": "int", "temperature": "float", "top_p": "float", "n": "int", "best_of": "int",
              "logprobs": "int", "stop": "strs", "seed": "int", "presence_penalty": "float",
              "frequency_penalty": "float", "logit_bias": "dict", "top_k": "int", "min_p": "float",
              "repetition_penalty": "float", "min_tokens": "int", "ignore_eos": "bool", "stop_token_ids": "ints",
              "echo": "bool", "prompt": "str", "user": "str", "metadata": "dict", "stream": "bool",
              "model": "str", "suffix": "str"}
CHAT_FIELDS = {k: v for k, v in LLM_FIELDS.items() if k not in ("best_of", "echo", "prompt", "suffix", "logprobs")}
CHAT_FIELDS.update({"top_logprobs": "int", "logprobs": "bool", "max_completion_tokens": "int"})
RETRIEVAL_FIELDS = {"history_items": "ints", "history_sids": "intss", "history_tokens": "ints", "beam_width": "int",
                    "top_n": "int", "exclude_items": "ints", "include_items": "ints", "include_sid_prefix": "ints",
                    "request_id": "str", "max_think_tokens": "int"}
RANK_FIELDS = {"user_id": "int", "user_tokens": "ints", "candidates": "ints", "candidate_tokens": "intss",
               "top_k": "int", "request_id": "str"}


def fuzz_cases(server: str, rng: random.Random, model: str):
    """(path, body) pairs: a valid request with 1-3 fields replaced by absurd values of their type."""
    while True:
        if server == "llm":
            if rng.random() < 0.5:
                path, base, fields = "/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 8}, LLM_FIELDS
            else:
                path, base, fields = ("/v1/chat/completions", {"model": model, "max_tokens": 8,
                                      "messages": [{"role": "user", "content": "hi"}]}, CHAT_FIELDS)
        elif server == "retrieval":
            path, base, fields = "/v1/recommend", {"history_items": [1, 2, 3], "top_n": 5}, RETRIEVAL_FIELDS
        else:
            path, base, fields = "/v1/rank", {"user_id": 1, "candidates": [1, 2, 3, 4]}, RANK_FIELDS
        body = dict(base)
        for name in rng.sample(sorted(fields), rng.randint(1, 3)):
            body[name] = absurd(rng, fields[name])
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": rng.random() < 0.5}
        yield path, body


LOG = None  # --log FILE: every request's label, status and the answer's first 300 characters


class Tally:
    def __init__(self) -> None:
        self.status: collections.Counter = collections.Counter()
        self.sent = 0
        self.hangs: list[str] = []
        self.bad: list[str] = []  # 5xx, error-as-success, 429 without Retry-After

    def note(self, what: str, status: int | str, text: str, seconds: float, headers=None) -> None:
        self.sent += 1
        if status == 200 and text.startswith("data:"):  # a stream may end with an error event: count it apart
            last = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")][-1:]
            if last and last[0] != "[DONE]" and '"error"' in last[0]:
                status = f"200 stream ended by error {json.loads(last[0])['error'].get('code')}"
                text = ""
        self.status[status] += 1
        if LOG:
            LOG.write(json.dumps({"what": what, "status": status, "s": round(seconds, 3), "text": text[:300],
                                  "retry_after": headers.get("retry-after") if headers is not None else None}) + "\n")
        if seconds > 5:
            self.hangs.append(f"{what}: {status} after {seconds:.1f} s")
        if isinstance(status, int) and status >= 500 and "stopped" not in text and "queue_timeout" not in text:
            self.bad.append(f"{what}: {status} {text[:200]}")
        if status == 429 and headers is not None and "retry-after" not in headers:
            self.bad.append(f"{what}: 429 without Retry-After")
        if status == 200:
            problem = check_ok(text)
            if problem:
                self.bad.append(f"{what}: 200 but {problem}: {text[:150]} ... {text[-150:]}")


def check_ok(text: str) -> str | None:
    """A 200 must not carry an error or an unfinished result."""
    if text.startswith("data:"):  # an SSE stream: [DONE] last, no error event, every choice finished
        events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "stream without [DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        if any("error" in c for c in chunks):
            return "an error event in the stream"
        finished = {(c.get("index", 0)) for ch in chunks for c in ch.get("choices", []) if c.get("finish_reason")}
        started = {(c.get("index", 0)) for ch in chunks for c in ch.get("choices", [])}
        return None if started <= finished else f"choices {sorted(started - finished)} never finished"
    try:
        d = json.loads(text)
    except ValueError:
        return None  # /metrics and the like
    if not isinstance(d, dict):
        return None
    if "error" in d:
        return "an error body"
    for c in d.get("choices", []):
        if "finish_reason" in c and c["finish_reason"] not in ("stop", "length", "tool_calls"):
            return f"finish_reason {c['finish_reason']!r}"
    for it in d.get("items", []):
        for k in ("score", "logprob"):
            if k in it and not isinstance(it[k], (int, float)):
                return f"{k} {it[k]!r}"
    return None


async def send(client: httpx.AsyncClient, tally: Tally, what: str, path: str, body=None, content=None,
               timeout: float = 60.0, headers=None):
    t0 = time.perf_counter()
    try:
        if body is not None:  # ensure_ascii: lone surrogates travel as \ud800 escapes
            content, headers = json.dumps(body).encode(), {"content-type": "application/json"}
        r = await client.post(path, content=content, timeout=timeout, headers=headers)
        tally.note(what, r.status_code, r.text, time.perf_counter() - t0, r.headers)
        return r
    except httpx.TimeoutException:
        tally.note(what, "timeout", "", time.perf_counter() - t0)
    except httpx.HTTPError as e:
        tally.note(what, type(e).__name__, "", time.perf_counter() - t0)
    return None


def poll_health(url: str, stop, conn) -> None:
    """In a process of its own, so the clients' work never delays a poll."""
    polls = []
    with httpx.Client(base_url=url) as c:
        while not stop.is_set():
            t0 = time.time()
            try:
                c.get("/health", timeout=10)
            except httpx.HTTPError:
                pass
            polls.append((t0, time.time() - t0))
            time.sleep(0.05)
    conn.send(polls)


def heavy_bodies(server: str, model: str):
    big = "word " * 1_560_000  # 7.8 MB
    if server == "llm":
        return [("/v1/completions", {"model": model, "prompt": big, "max_tokens": 4}),
                ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": big}]}),
                ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}] * 100000}),
                ("/v1/completions", {"model": model, "prompt": [5] * 700000})]
    if server == "retrieval":
        return [("/v1/recommend", {"history_items": [1] * 1_000_000}),
                ("/v1/recommend", {"history_tokens": [20] * 1_000_000, "truncate": "none"}),
                ("/v1/recommend", {"history_items": [1, 2], "exclude_items": list(range(1_000_000))})]
    return [("/v1/rank", {"user_tokens": [5] * 1_000_000, "candidates": [1, 2]}),
            ("/v1/rank", {"user_id": 1, "candidates": [1] * 1_000_000}),
            ("/v1/rank", {"user_id": 1, "candidate_tokens": [[5, 6]] * 100_000})]


def normal(server: str, model: str, tokens: int = 8):
    if server == "llm":
        return "/v1/completions", {"model": model, "prompt": "hello there", "max_tokens": tokens, "ignore_eos": True}
    if server == "retrieval":
        return "/v1/recommend", {"history_items": [1, 2, 3], "top_n": 5}
    return "/v1/rank", {"user_id": 1, "candidates": [1, 2, 3, 4]}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--server", choices=["llm", "retrieval", "ranking"], required=True)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--phases", default="fuzz,big,burst,disconnect")
    ap.add_argument("--fuzz", type=int, default=300, help="fuzz cases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pid", type=int, help="the server's pid (phase sigterm)")
    ap.add_argument("--term-requests", type=int, default=24, help="requests in flight at SIGTERM (+8 streamed, LLM)")
    ap.add_argument("--term-after", type=float, default=1.5, help="seconds of load before SIGTERM")
    ap.add_argument("--log", help="write every request and its status here (JSON lines)")
    a = ap.parse_args()
    global LOG
    LOG = open(a.log, "w") if a.log else None
    rng = random.Random(a.seed)
    stop, (recv, conn) = multiprocessing.Event(), multiprocessing.Pipe(duplex=False)
    poller = multiprocessing.Process(target=poll_health, args=(a.url, stop, conn), daemon=True)
    poller.start()
    phases = []
    report = {}
    limits = httpx.Limits(max_connections=400)
    async with httpx.AsyncClient(base_url=a.url, limits=limits) as client:
        for phase in a.phases.split(","):
            t, t0, w0 = Tally(), time.perf_counter(), time.time()
            if phase == "fuzz":
                cases = fuzz_cases(a.server, rng, a.model)
                for i in range(a.fuzz):
                    path, body = next(cases)
                    await send(client, t, f"fuzz#{i} {path} {json.dumps(body)[:300]}", path, body, timeout=30)
            elif phase == "big":
                path, _ = normal(a.server, a.model)
                await send(client, t, "20MB body", path, content=b"[" + b"1," * 10_000_000 + b"1]",
                           headers={"content-type": "application/json"})
                await asyncio.gather(*[send(client, t, f"heavy {p} {list(b)}", p, b)
                                       for p, b in heavy_bodies(a.server, a.model) for _ in range(2)])
            elif phase == "burst":
                path, body = normal(a.server, a.model, 16)
                async with httpx.AsyncClient(base_url=a.url, limits=limits) as fresh:  # no pooled connections
                    await asyncio.gather(*[send(fresh, t, f"burst {path}", path, body, timeout=120)
                                           for _ in range(300)])
            elif phase == "disconnect":
                path, body = normal(a.server, a.model, 64)

                async def leave(i: int) -> None:
                    task = asyncio.create_task(client.post(path, json=body, timeout=60))
                    await asyncio.sleep(rng.uniform(0.01, 1.0))
                    task.cancel()
                    t.sent += 1
                    t.status["client left"] += 1
                await asyncio.gather(*[leave(i) for i in range(40)])
                deadline = time.perf_counter() + 30
                while time.perf_counter() < deadline:  # the engine must drain what the leavers left
                    h = (await client.get("/health")).json()
                    busy = h.get("queue_depth", 0) + h.get("running", 0) + h.get("waiting", 0)
                    if not busy:
                        break
                    await asyncio.sleep(0.2)
                report["disconnect: idle after"] = round(time.perf_counter() - (deadline - 30), 2)
                report["disconnect: /health after"] = h
                await send(client, t, "after leavers", path, body)
            elif phase == "sigterm":
                path, body = normal(a.server, a.model, 200)
                sbody = dict(body, stream=True) if a.server == "llm" else None
                jobs = [send(client, t, f"sigterm {path}", path, body, timeout=60) for _ in range(a.term_requests)]
                if sbody:
                    jobs += [send(client, t, f"sigterm stream {path}", path, sbody, timeout=60) for _ in range(8)]

                async def term() -> None:
                    await asyncio.sleep(a.term_after)
                    os.kill(a.pid, signal.SIGTERM)
                results = await asyncio.gather(term(), *jobs)
                for r in results[1:]:  # a 200 must have every token / item it was asked for
                    if r is None or r.status_code != 200 or r.text.startswith("data:"):
                        continue
                    d = r.json()
                    got, want = ((d["usage"]["completion_tokens"], 200) if a.server == "llm" else
                                 (len(d["items"]), 5 if a.server == "retrieval" else 4))
                    t.status[f"200 complete ({want})"] += got == want
                    if got != want:
                        t.bad.append(f"sigterm: 200 with {got} of {want}")
            report[phase] = {"requests": t.sent, "status": dict(t.status), "hangs>5s": t.hangs, "bad": t.bad,
                             "seconds": round(time.perf_counter() - t0, 1)}
            phases.append((phase, w0, time.time()))
    stop.set()
    worst = recv.recv()
    poller.join()
    for phase, w0, w1 in phases:
        polls = [w for s, w in worst if w0 <= s < w1]
        report[phase].update(health_polls=len(polls), health_max_s=round(max(polls, default=0), 3))
        print(json.dumps({phase: report[phase]}, default=str)[:4000], flush=True)
    report["health"] = {"polls": len(worst), "max_s": round(max((w for _, w in worst), default=0), 3),
                        "over_0.5s": [(round(s - worst[0][0], 1), round(w, 3)) for s, w in worst if w > 0.5]}
    print(json.dumps({k: v for k, v in report.items() if k not in a.phases.split(",")}, default=str))


if __name__ == "__main__":
    asyncio.run(main())
