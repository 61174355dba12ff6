"""The package's placement rule, checked (docs/architecture.md, "The shape of the code"):

- what imports FastAPI / Starlette lives in ``server/``; what a request means (``inputs/``), the offline APIs
  (``Recommender``, ``LLM``, ``grserve recommend``) and every other module import neither, directly or lazily;
- no folder under ``server/`` holds more than 10 modules, no product folder more than 16;
- every route of every app has its row in the app's route table (``server/http/routes.py``), where the edge, the
  body reader and the error handlers read its policy.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "grserve"
HTTP_PACKAGES = ("fastapi", "starlette")
MAX_SERVER_FOLDER = 10
MAX_PRODUCT_FOLDER = 16


def _imported(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` of the file names, at any depth (lazy imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_http_import_outside_server():
    server = PACKAGE / "server"
    found = [f"{path.relative_to(PACKAGE)}: {name}"
             for path in sorted(PACKAGE.rglob("*.py")) if server not in path.parents
             for name in sorted(_imported(path)) if name.split(".")[0] in HTTP_PACKAGES]
    assert not found, found


@pytest.mark.parametrize("module", ["grserve.recommender", "grserve.llm_api", "grserve.recommend_main",
                                    "grserve.inputs.retrieval", "grserve.inputs.generation"])
def test_offline_apis_load_no_http_module(module):
    code = (f"import sys, json, {module}\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HTTP_PACKAGES!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""}, cwd=ROOT).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []


def _modules(folder: Path) -> int:
    return sum(1 for p in folder.glob("*.py") if p.name != "__init__.py")  # modules, as the issue counts them


def test_folders_stay_small():
    server = PACKAGE / "server"
    too_big = [f"{d.relative_to(PACKAGE)}: {_modules(d)}" for d in sorted(server.rglob("*")) if d.is_dir()
               and d.name != "__pycache__" and _modules(d) > MAX_SERVER_FOLDER]
    too_big += [f"{d.relative_to(PACKAGE)}: {_modules(d)}" for d in sorted([PACKAGE, *PACKAGE.rglob("*")])
                if d.is_dir() and d != PACKAGE and d.name != "__pycache__" and _modules(d) > MAX_PRODUCT_FOLDER]
    assert not too_big, too_big


def _leaf_routes(routes):
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _leaf_routes(inner.routes)
        elif hasattr(route, "methods") and hasattr(route, "path"):
            yield route


FASTAPI_DOCS = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


@pytest.fixture(scope="module")
def apps():
    """The three apps, each around a stand-in engine (routes and tables are built without running anything)."""
    from types import SimpleNamespace

    from grserve.config import ServerConfig
    from grserve.server.llm.app import create_llm_app
    from grserve.server.ranking.app import create_ranking_app
    from grserve.server.retrieval.app import create_app

    retrieval = SimpleNamespace(catalogs=SimpleNamespace(current=lambda: None), vocab_size=64, tokenizer=None, queue_depth=0, stats=dict,
                                search=SimpleNamespace(beam_width=4, max_beam_width=8))
    runner = SimpleNamespace(policy=SimpleNamespace(name="p"), registry=None, stats=None)
    ranking = SimpleNamespace(runner=runner, registry=None, queue_depth=0, stats=dict, on_batch=None)
    llm = SimpleNamespace(queue_depth=0, stats=dict)
    return {"retrieval": create_app(retrieval, ServerConfig()), "ranking": create_ranking_app(ranking),
            "llm": create_llm_app(llm, None, "m", 64, 64)}


@pytest.mark.parametrize("name", ["retrieval", "ranking", "llm"])
def test_every_route_is_in_its_apps_route_table(apps, name):
    app = apps[name]
    table = app.state.routes
    missing = [(m, r.path) for r in _leaf_routes(app.routes) if r.path not in FASTAPI_DOCS
               for m in sorted(r.methods - {"HEAD"}) if table.row(m, r.path) is None]
    assert not missing, missing
    declared = {(m, r.path) for r in _leaf_routes(app.routes) for m in r.methods}
    assert {(r.method, r.path) for r in table.routes} <= declared  # and no row names a route the app lacks
