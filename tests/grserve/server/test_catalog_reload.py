"""Issue 14 finding 2, the catalog route: reload only by name from --catalog-dir, regular files only (a FIFO is
refused without blocking), a size limit, a parse that streams and can be abandoned, a deadline after which the
reload is never applied, one reload at a time, and errors that never quote file content or say whether a file
outside the directory exists."""

from __future__ import annotations

import io
import os
import threading
import time

import pytest
from fastapi.testclient import TestClient

from grserve.catalog import CatalogError, CatalogStore, generate_catalog, save_catalog
from grserve.catalog.io import MAX_LINE_CHARS, read_catalog
from grserve.config import CatalogReloadConfig, EdgeConfig, SearchConfig, ServerConfig
from grserve.engine.protocol import EngineHealth
from grserve.server.retrieval import catalog_reload
from grserve.server.retrieval.app import create_app

ADMIN = {"Authorization": "Bearer adm"}


class CatalogOnlyEngine:
    """Just what the catalog route and /health read."""

    def __init__(self) -> None:
        self.catalogs = CatalogStore(generate_catalog(100, 3, 8, 0, 16), vocab_size=64)
        self.vocab_size = 64
        self.search = SearchConfig(beam_width=8, max_beam_width=16)

    def health(self) -> EngineHealth:
        return EngineHealth("ok", 0, 0)

    @property
    def queue_depth(self) -> int:
        return 0


def _client(catalog_dir, **reload) -> tuple[CatalogOnlyEngine, TestClient]:
    eng = CatalogOnlyEngine()
    app = create_app(eng, ServerConfig(), edge=EdgeConfig(admin_api_key="adm"),
                     reload=CatalogReloadConfig(catalog_dir=str(catalog_dir), **reload))
    return eng, TestClient(app, raise_server_exceptions=False, headers=ADMIN)


def _reload(client, name):
    return client.post("/v1/catalog", json={"name": name})


@pytest.fixture()
def dirs(tmp_path):
    cat_dir, outside = tmp_path / "catalogs", tmp_path / "outside"
    cat_dir.mkdir()
    outside.mkdir()
    (outside / "secret.jsonl").write_text('{"item_id": "SECRET_outside", "sid": [0, 0, 0]}\n')
    return cat_dir, outside


def test_only_plain_names_inside_the_directory(dirs):
    cat_dir, outside = dirs
    eng, client = _client(cat_dir)
    for name in ("../outside/secret.jsonl", str(outside / "secret.jsonl"), "a/b.jsonl", ".hidden.jsonl", "..jsonl",
                 "x.jsonl/..", "secret.txt", "x.jsonl\x00", "x" * 300 + ".jsonl", "%2e%2e/secret.jsonl"):
        r = _reload(client, name)
        assert r.status_code in (400, 422), (name, r.text)
        assert "secret" not in r.json()["error"]["message"].lower() or r.status_code == 422, name
    # a symlink to a file outside, and one to nothing: the same refusal (existence outside is not revealed)
    os.symlink(outside / "secret.jsonl", cat_dir / "link.jsonl")
    os.symlink(outside / "missing.jsonl", cat_dir / "dangling.jsonl")
    answers = [_reload(client, n).json()["error"] for n in ("link.jsonl", "dangling.jsonl")]
    assert answers[0] == answers[1] and answers[0]["type"] == "not_a_regular_file"
    assert _reload(client, "missing.jsonl").json()["error"]["type"] == "catalog_not_found"
    assert eng.catalogs.current().version == 1


def test_a_fifo_is_refused_at_once(dirs):
    """The issue: 45 FIFOs starved every later reload and SIGTERM could not stop the server."""
    cat_dir, _ = dirs
    os.mkfifo(cat_dir / "pipe.jsonl")
    eng, client = _client(cat_dir)
    t0 = time.perf_counter()
    for _ in range(5):
        r = _reload(client, "pipe.jsonl")
        assert r.status_code == 400 and r.json()["error"]["type"] == "not_a_regular_file"
    assert time.perf_counter() - t0 < 5
    save_catalog(generate_catalog(50, 3, 8, 3, 16), cat_dir / "good.grcat")
    assert _reload(client, "good.grcat").status_code == 200  # later reloads are not starved


def test_an_opened_fifo_never_blocks(dirs, monkeypatch):
    """Even if a FIFO replaces the file between the lstat and the open, the open is non-blocking and the fstat
    refuses it."""
    cat_dir, _ = dirs
    os.mkfifo(cat_dir / "swap.jsonl")
    monkeypatch.setattr(catalog_reload, "_lstat", lambda name, dir_fd: os.stat(__file__))  # lstat "sees" a file
    t0 = time.perf_counter()
    with pytest.raises(catalog_reload.ApiError) as e:
        catalog_reload.open_catalog(str(cat_dir), "swap.jsonl", 1 << 20)
    assert e.value.type == "not_a_regular_file" and time.perf_counter() - t0 < 2


SECRET_FILES = {
    "a.csv": "item_id,sid\n1,0-0-0\n2,SECRET_csv\n",
    "b.csv": "# codebook_sizes=8,SECRET_comment\nitem_id,sid\n1,0-0-0\n",
    "c.csv": "item_id,c1,c2,c3\nSECRET_id,0,0,0\n",
    "d.jsonl": '{"item_id": 1, "sid": [0, 0, "SECRET_code"]}\n',
    "e.jsonl": '{"item_id": "SECRET_id", "sid": [0, 0, 0]}\n',
    "f.jsonl": '{"item_id": 1, "sid": "SECRET_sid"}\n',
    "g.jsonl": "SECRET_not_json\n",
    "h.jsonl": '{"codebook_sizes": "SECRET_sizes"}\n',
    "i.grcat": b"GRCAT1" + (27).to_bytes(4, "little") + b'{"depth": "SECRET_header"}\n',
    "j.jsonl": b'{"item_id": 1, "sid": [0, 0, 0]}\n\xffSECRET_bytes\n',
}


def test_errors_never_quote_file_content(dirs):
    cat_dir, _ = dirs
    eng, client = _client(cat_dir)
    for name, content in SECRET_FILES.items():
        (cat_dir / name).write_bytes(content if isinstance(content, bytes) else content.encode())
        r = _reload(client, name)
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert err["type"] == "catalog_load_failed" and "SECRET" not in r.text, (name, err)
        assert str(cat_dir) not in err["message"]  # the server's paths are not shown either
    assert eng.catalogs.current().version == 1


def test_size_limit(dirs):
    cat_dir, _ = dirs
    save_catalog(generate_catalog(100, 3, 8, 3, 16), cat_dir / "big.jsonl")
    eng, client = _client(cat_dir, max_catalog_bytes=1000)
    r = _reload(client, "big.jsonl")
    assert r.status_code == 413 and r.json()["error"]["type"] == "catalog_too_large"
    (cat_dir / "long.jsonl").write_text("[" * (MAX_LINE_CHARS + 10) + "\n")
    _, roomy = _client(cat_dir)
    r = _reload(roomy, "long.jsonl")
    assert r.status_code == 400 and "longer than" in r.json()["error"]["message"]


def test_capped_reader_stops_a_file_that_grows(tmp_path):
    p = tmp_path / "grow.jsonl"
    p.write_bytes(b"x" * 5000)
    raw = catalog_reload.CappedReader(os.open(p, os.O_RDONLY), 1000)  # fstat said <= 1000; it is 5000 now
    with pytest.raises(catalog_reload.ApiError) as e, io.BufferedReader(raw) as f:
        f.read()
    assert e.value.status == 413


def test_a_parse_can_be_abandoned(tmp_path):
    p = tmp_path / "c.jsonl"
    save_catalog(generate_catalog(20000, 3, 64, 0, 16), p)
    calls = []

    def check():
        calls.append(1)
        raise catalog_reload.ReloadAbandoned("c.jsonl")

    with open(p, "rb") as f, pytest.raises(catalog_reload.ReloadAbandoned):
        read_catalog(f, ".jsonl", "c.jsonl", p.stat().st_size, check=check)
    assert calls == [1]  # stopped at the first check (4096 lines in), not at the end of the file
    with open(p, "rb") as f:
        assert len(read_catalog(f, ".jsonl", "c.jsonl", p.stat().st_size, check=lambda: None)) == 20000
    with open(p, "rb") as f, pytest.raises(CatalogError, match="extension"):
        read_catalog(f, ".parquet", "c", 1)


def test_a_timed_out_reload_is_never_applied_and_reloads_are_serialized(dirs, monkeypatch):
    """The issue: an abandoned reload was applied later. Here the parse outlives its deadline: the client gets a
    504, a second reload meanwhile waits a bounded time (429), and when the stuck parse finally returns its
    catalog is dropped; the slot frees and the next reload works."""
    cat_dir, _ = dirs
    save_catalog(generate_catalog(50, 3, 8, 3, 16), cat_dir / "good.grcat")
    release, started = threading.Event(), threading.Event()
    real = catalog_reload.load_for_serving

    def stuck(*args, **kwargs):
        started.set()
        release.wait(10)
        return real(*args[:5])  # a valid catalog, returned after the deadline

    monkeypatch.setattr(catalog_reload, "load_for_serving", stuck)
    eng, client = _client(cat_dir, catalog_timeout=0.2, reload_wait=0.1)
    t0 = time.perf_counter()
    r = _reload(client, "good.grcat")
    assert r.status_code == 504 and r.json()["error"]["type"] == "reload_timeout" and time.perf_counter() - t0 < 3
    busy = _reload(client, "good.grcat")
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["type"] == "reload_busy"
    release.set()
    reloader = client.app.state.reloader
    for _ in range(200):
        if reloader._slot.acquire(blocking=False):
            reloader._slot.release()
            break
        time.sleep(0.01)
    time.sleep(0.05)
    assert eng.catalogs.current().version == 1 and reloader.abandoned == 1  # never applied
    monkeypatch.setattr(catalog_reload, "load_for_serving", real)
    assert _reload(client, "good.grcat").json()["catalog"]["version"] == 2


def test_reload_is_off_without_a_catalog_dir():
    app = create_app(CatalogOnlyEngine(), ServerConfig(), edge=EdgeConfig(admin_api_key="adm"))
    r = TestClient(app, headers=ADMIN).post("/v1/catalog", json={"name": "x.jsonl"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "reload_disabled"


def test_a_reload_names_the_bad_sid_token_and_the_item_holding_it(minionerec_dir, tmp_path):
    """A reloaded index whose SID token is not one token of the tokenizer: the error names the token (it is shaped
    like one) and an item that holds it; a string of any other shape is not quoted."""
    import json

    from grserve.catalog import load_catalog
    from grserve.catalog.sid_text import SidTokenError, bind_catalog
    from grserve.config import CatalogConfig, ModelConfig, ServeConfig
    from grserve.engine.retrieval_engine import RetrievalEngine

    cfg = ServeConfig(model=ModelConfig(source=str(minionerec_dir.path)),
                      catalog=CatalogConfig(path=str(minionerec_dir.catalog)))
    engine = RetrievalEngine.build(cfg)
    index = {str(i): row for i, row in enumerate(minionerec_dir.strings)}
    index["7"] = [index["7"][0], "<b_999>", index["7"][2]]
    (tmp_path / "bad.json").write_text(json.dumps(index))
    index["7"] = [index["7"][0], "SECRET text", index["7"][2]]
    (tmp_path / "odd.json").write_text(json.dumps(index))
    app = create_app(engine, ServerConfig(), edge=EdgeConfig(admin_api_key="adm"),
                     reload=CatalogReloadConfig(catalog_dir=str(tmp_path)))
    client = TestClient(app, raise_server_exceptions=False, headers=ADMIN)
    err = _reload(client, "bad.json").json()["error"]
    assert err["type"] == "catalog_load_failed" and "'<b_999>'" in err["message"] and "item 7" in err["message"]
    err = _reload(client, "odd.json").json()["error"]
    assert "SECRET" not in err["message"] and "item 7" in err["message"]
    with pytest.raises(SidTokenError) as exc:  # start-up and `grserve catalog validate` name them alike
        bind_catalog(load_catalog(tmp_path / "bad.json"), engine.tokenizer)
    assert exc.value.item_id == 7 and "'<b_999>' (held by item 7)" in str(exc.value)
