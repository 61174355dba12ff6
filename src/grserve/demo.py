"""``python -m grserve.demo`` (``make demo``): serve the embedded default and send it a few requests.

Starts the real engine (preset ``tiny`` with seeded random weights, a generated 20,000-item catalog) behind the
real HTTP app on 127.0.0.1 and a free port, in a background thread; waits for /health; sends one request per
history kind (item ids, SIDs, raw tokens) plus one deliberately bad request; prints the answers and a few
/metrics lines; shuts everything down and exits 0. Needs no network and no GPU.
"""

from __future__ import annotations

import json
import socket
import sys
import urllib.error
import urllib.request
import threading
import time
from typing import Any

BEAM_WIDTH = 64
TOP_N = 5


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


def _print_results(console: Any, title: str, history: str, resp: Any, wall_ms: float) -> None:
    from rich.table import Table

    body = resp.json()
    t = body["timing"]
    table = Table(title=f"{title}  →  HTTP {resp.status_code}", title_justify="left", show_lines=False)
    table.add_column("rank", justify="right")
    table.add_column("item_id", justify="right")
    table.add_column("SID")
    table.add_column("score (log-prob)", justify="right")
    for rank, item in enumerate(body["items"], 1):
        table.add_row(str(rank), str(item["item_id"]), str(item["sid"]), f"{item['score']:.3f}")
    console.print(f"[bold]history[/bold] {history}")
    console.print(table)
    console.print(f"  beam width {body['beam_width']}, catalog v{body['catalog_version']}, batch of "
                  f"{body['batch_size']} | queue {t['queue_ms']:.1f} ms, compute {t['compute_ms']:.1f} ms, "
                  f"server total {t['total_ms']:.1f} ms, round trip {wall_ms:.1f} ms\n")


def _short(values: list, n: int = 6) -> str:
    return str(values[:n])[:-1] + (", ...]" if len(values) > n else "]")


def main(argv: list[str] | None = None) -> int:
    import uvicorn
    from rich.console import Console

    from grserve.config import ServeConfig
    from grserve.engine.engine import RetrievalEngine
    from grserve.server.app import create_app
    from grserve.server.metrics import Metrics

    console = Console()
    cfg = ServeConfig()
    t0 = time.perf_counter()
    console.print(f"[bold]grserve demo[/bold]: building the engine (model preset {cfg.model.source!r}, "
                  f"generated {cfg.catalog.num_items:,}-item catalog, {cfg.model.device}) ...")
    metrics = Metrics()
    engine = RetrievalEngine.build(cfg, on_batch=metrics.on_batch)
    app = create_app(engine, cfg.server, metrics)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # a free port, held from now on (no race with other processes)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="grserve-demo-http", daemon=True)
    base = f"http://127.0.0.1:{port}"

    engine.start()
    thread.start()
    try:
        http = _Http(base)
        deadline = time.perf_counter() + 60
        while True:
            try:
                health = http.get("/health")
                if health.status_code == 200:
                    break
            except OSError:  # connection refused / reset while starting (URLError is an OSError)
                pass
            if time.perf_counter() > deadline or not thread.is_alive():
                console.print("[red]the server did not come up[/red]")
                return 1
            time.sleep(0.05)
        h = health.json()
        console.print(f"server up at {base} in {time.perf_counter() - t0:.1f} s: catalog "
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
            start = time.perf_counter()
            resp = http.post("/v1/recommend", payload)
            wall = (time.perf_counter() - start) * 1e3
            if resp.status_code != 200:
                console.print(f"[red]{title}: HTTP {resp.status_code} {resp.text}[/red]")
                return 1
            _print_results(console, title, history, resp, wall)

        bad = {"history_sids": [[3, 999, 0]], "beam_width": BEAM_WIDTH}
        resp = http.post("/v1/recommend", bad)
        console.print(f"[bold]4. a deliberately bad request[/bold] {bad}\n  → HTTP {resp.status_code} "
                      f"{resp.json()}\n")
        if not 400 <= resp.status_code < 500:
            return 1

        text = http.get("/metrics").text
        wanted = ("grserve_requests_total{", "grserve_batch_size_count", "grserve_batch_size_sum",
                  "grserve_items_returned_sum", "grserve_queue_depth ", "grserve_request_latency_seconds_count")
        console.print("[bold]/metrics[/bold] (excerpt)")
        for line in text.splitlines():
            if line.startswith(wanted):
                console.print(f"  {line}", markup=False, highlight=False)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.stop()
        sock.close()
    console.print("\nserver stopped; demo done.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
