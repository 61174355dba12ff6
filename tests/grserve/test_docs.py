"""The docs name only what exists.

``docs/papers.md`` maps the papers' mechanisms to code and tests. Every backticked reference in it is a path from
the repository root, optionally followed by ``::name`` (a function or class of that file; ``Class.method`` for a
method), and every row of its tables names the code and the test, or says the mechanism is not built. The other
docs name files relative to the package (``kvcache/beam.py``); those must exist under one of the source roots.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAPERS = DOCS / "papers.md"
TICKED = re.compile(r"`([^`\n]+)`")
FILE_EXT = r"(?:py|md|json|jsonl|sh|toml|txt)"
REF = re.compile(rf"(?P<path>[\w./-]+\.{FILE_EXT})(?:::(?P<name>[A-Za-z_][\w.]*))?")
SINGLE_COLON = re.compile(r"[\w./-]+\.py:[A-Za-z_]")
PATHLIKE = re.compile(rf"(?<![\w./-])[\w.-]+(?:/[\w.-]+)+\.{FILE_EXT}")
# Where the package-relative names of the other docs may live.
ROOTS = (ROOT, ROOT / "src", ROOT / "src" / "grserve", ROOT / "src" / "grserve_bench")


@cache
def _defs(path: Path) -> frozenset[str]:
    """Every def and class of a file, with ``Class.method`` for what a class body defines."""
    names: set[str] = set()

    def walk(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + node.name)
                if isinstance(node, ast.ClassDef):
                    walk(node.body, prefix + node.name + ".")

    walk(ast.parse(path.read_text()).body, "")
    return frozenset(names)


def _papers_refs() -> list[tuple[int, str]]:
    return [(n, m) for n, line in enumerate(PAPERS.read_text().splitlines(), 1) for m in TICKED.findall(line)]


def test_papers_md_references_exist_and_name_real_definitions():
    problems = []
    refs = 0
    for line, span in _papers_refs():
        if SINGLE_COLON.search(span):
            problems.append(f"line {line}: `{span}`: write path::name (two colons)")
            continue
        m = REF.fullmatch(span)
        if m is None:
            if "/" in span and ".py" in span:
                problems.append(f"line {line}: `{span}` is not of the form path or path::name")
            continue
        refs += 1
        path = ROOT / m["path"]
        if not path.is_file():
            problems.append(f"line {line}: `{span}`: no file {m['path']}")
        elif m["name"] is not None:
            if path.suffix != ".py":
                problems.append(f"line {line}: `{span}`: a name can only follow a .py file")
            elif m["name"] not in _defs(path):
                problems.append(f"line {line}: `{span}`: {m['path']} defines no {m['name']}")
    assert refs > 100, "docs/papers.md names too little to be the map"
    assert not problems, "\n".join(problems)


def test_every_mechanism_row_names_its_code_and_its_test():
    """A row of a mechanism table names a file under src/ and one under tests/, or says it is not built."""
    problems = []
    rows = 0
    for n, line in enumerate(PAPERS.read_text().splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 3 or set(cells[0]) <= set("-: ") or cells[0] == "mechanism (paper's words)":
            continue
        rows += 1
        spans = TICKED.findall(line)
        has_src = any(s.startswith("src/") for s in spans)
        has_test = any(s.startswith("tests/") for s in spans)
        if not (has_src and has_test) and "not built" not in line:
            problems.append(f"line {n}: {cells[0]!r} lacks {'code' if not has_src else 'a test'}")
    assert rows > 60
    assert not problems, "\n".join(problems)


def test_every_doc_names_only_files_that_exist():
    """A path in any doc (``kvcache/beam.py``, ``src/grserve/...``, ``tests/...``) exists under a source root."""
    problems = []
    for doc in sorted(DOCS.glob("*.md")) + sorted(DOCS.glob("results/*.md")) + [ROOT / "README.md"]:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for span in TICKED.findall(line):
                for path in PATHLIKE.findall(span):
                    if path.startswith(("/", "../", "shared/", ".grserve-cache", "bench-results")):
                        continue
                    if not any((base / path).exists() for base in ROOTS):
                        problems.append(f"{doc.relative_to(ROOT)}:{n}: `{span}`: no {path}")
    assert not problems, "\n".join(problems)
