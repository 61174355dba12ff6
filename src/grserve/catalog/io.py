"""Catalog files: .jsonl, .csv and the compact binary .grcat, and the one loader every path uses.

A catalog maps item ids to SIDs; its *layout* (depth, ``codebook_sizes``, ``token_offset``) says which model
tokens a SID becomes (``SidLayout``). The layout is the training-time one, so a file should carry it:

- ``.jsonl``: an optional first line ``{"codebook_sizes": [256, 256, 256], "token_offset": 16}`` (either key may
  be left out), then one ``{"item_id": 7, "sid": [12, 0, 255]}`` per line;
- ``.csv``: optional leading comment lines ``# codebook_sizes=256,256,256`` and ``# token_offset=16``, then the
  header ``item_id,sid`` (SIDs written ``12-0-255``) or ``item_id,c1,c2,...`` and one row per item;
- ``.grcat``: ``GRCAT1``, a little-endian u32 header length, a JSON header ``{"depth", "codebook_sizes",
  "count", "token_offset"}`` (``token_offset`` optional), then ``count`` int64 item ids and ``count x depth``
  int32 codes.

``load_catalog`` resolves the layout the same way for every caller (start-up and ``POST /v1/catalog`` alike):
codebook sizes the caller gives, else the file's declared ones, else inferred from the file (``max code + 1``
per level — only right when every code of the last value of each level occurs: declare them); the token offset
the caller gives, else the file's, else 16. A caller's value that contradicts the file's declaration is an error.
``save_catalog`` always writes the layout.
"""

from __future__ import annotations

import csv
import io
import json
import os
import struct
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TextIO

import numpy as np

from .catalog import Catalog, CatalogError

DEFAULT_TOKEN_OFFSET = 16
MAGIC = b"GRCAT1"
_HLEN = struct.Struct("<I")  # header length after the magic
_LAYOUT_KEYS = ("codebook_sizes", "token_offset")


MAX_LINE_CHARS = 1 << 20  # a catalog line is a few dozen characters; a longer one is an error, never buffered


def _int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CatalogError(f"{where}: expected an integer, got a JSON {_json_kind(value)}")
    return value


def _json_kind(value) -> str:
    """The JSON type of a value, for messages that must not quote file content."""
    return {bool: "boolean", str: "string", float: "number", list: "array", dict: "object",
            type(None): "null"}.get(type(value), "value")


def _declared_layout(obj: dict, where: str) -> dict:
    """{"codebook_sizes": tuple, "token_offset": int} from a header object (keys it lacks are left out)."""
    out: dict = {}
    if "codebook_sizes" in obj:
        sizes = obj["codebook_sizes"]
        if not isinstance(sizes, list) or not sizes:
            raise CatalogError(f"{where}: 'codebook_sizes' must be a non-empty list of integers")
        out["codebook_sizes"] = tuple(_int(c, where) for c in sizes)
    if "token_offset" in obj:
        out["token_offset"] = _int(obj["token_offset"], where)
    return out


class _Rows:
    """Item ids, flattened SID codes and line numbers, accumulated compactly (int64 arrays, not Python lists),
    the SID depth fixed by the first row."""

    def __init__(self) -> None:
        self.ids, self.codes, self.lines = array("q"), array("q"), array("q")
        self.depth: int | None = None

    def add(self, item: int, sid: list[int], lineno: int, where: str) -> None:
        if self.depth is None:
            self.depth = len(sid)
        if len(sid) != self.depth or not sid:
            raise CatalogError(f"{where}: SID {tuple(sid)} has depth {len(sid)}, expected {self.depth} (from the "
                               f"first item)")
        try:
            self.ids.append(item)
            self.codes.extend(sid)
        except OverflowError:
            raise CatalogError(f"{where}: an integer is outside the int64 range") from None
        self.lines.append(lineno)

    def __len__(self) -> int:
        return len(self.ids)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = len(self.ids)
        sids = np.frombuffer(self.codes, dtype=np.int64).reshape(n, self.depth or 0) if n else \
            np.zeros((0, 1), dtype=np.int64)
        return np.frombuffer(self.ids, dtype=np.int64), sids, np.frombuffer(self.lines, dtype=np.int64)


def _lines(f: TextIO, source: str, check: Callable[[], None] | None):
    """(line number, text) of a text file, one line at a time; ``check()`` every 4096 lines (a deadline)."""
    lineno = 0
    while True:
        try:
            text = f.readline(MAX_LINE_CHARS + 1)
        except UnicodeDecodeError:
            raise CatalogError(f"{source}: line {lineno + 1}: not UTF-8 text") from None
        if not text:
            return
        lineno += 1
        if len(text) > MAX_LINE_CHARS:
            raise CatalogError(f"{source}: line {lineno}: longer than {MAX_LINE_CHARS} characters")
        if check is not None and lineno % 4096 == 0:
            check()
        yield lineno, text


def _load_jsonl(f: TextIO, source: str, check: Callable[[], None] | None = None):
    rows, layout = _Rows(), {}
    for lineno, text in _lines(f, source, check):
        if not text.strip():
            continue
        where = f"{source}: line {lineno}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise CatalogError(f"{where}: bad JSON ({e.msg})") from None
        except RecursionError:
            raise CatalogError(f"{where}: bad JSON (nested too deeply)") from None
        if not len(rows) and not layout and isinstance(obj, dict) and "item_id" not in obj \
                and any(k in obj for k in _LAYOUT_KEYS):
            layout = _declared_layout(obj, where)  # the optional layout header (first line)
            continue
        if not isinstance(obj, dict) or "item_id" not in obj or "sid" not in obj:
            raise CatalogError(f"{where}: expected an object with 'item_id' and 'sid'")
        sid = obj["sid"]
        if not isinstance(sid, list):
            raise CatalogError(f"{where}: 'sid' must be a list of integers, got a JSON {_json_kind(sid)}")
        rows.add(_int(obj["item_id"], where), [_int(c, where) for c in sid], lineno, where)
    return rows, layout


def _csv_comment(text: str, lineno: int, source: str, layout: dict) -> None:
    """The layout declared in a leading ``# key=value`` comment line of a CSV catalog (other comments: free text)."""
    key, eq, value = text.lstrip("#").strip().partition("=")
    key = key.strip()
    if not eq or key not in _LAYOUT_KEYS:
        return
    try:
        numbers = [int(v) for v in value.split(",")]
    except ValueError:
        raise CatalogError(f"{source}: line {lineno}: bad integer in the {key} comment") from None
    layout.update(_declared_layout({key: numbers if key == "codebook_sizes" else numbers[0]},
                                   f"{source}: line {lineno}"))


def _load_csv(f: TextIO, source: str, check: Callable[[], None] | None = None):
    rows, layout = _Rows(), {}
    lines = _lines(f, source, check)
    header_line, header_no = "", 0
    for lineno, text in lines:
        if not text.startswith("#"):
            header_line, header_no = text, lineno
            break
        _csv_comment(text, lineno, source, layout)
    header = [h.strip() for h in next(csv.reader([header_line]), [])]
    if not header or header[0] != "item_id" or len(header) < 2:
        raise CatalogError(f"{source}: line {header_no or 1}: header must be 'item_id,sid' or 'item_id,c1,c2,...'")
    dashed = header == ["item_id", "sid"]
    numbers: dict[int, int] = {}

    def body():
        for lineno, text in lines:
            numbers[0] = lineno
            yield text

    for row in csv.reader(body()):
        lineno = numbers[0]
        if not any(cell.strip() for cell in row):
            continue
        where = f"{source}: line {lineno}"
        if dashed and len(row) != 2:
            raise CatalogError(f"{where}: expected 2 columns 'item_id,sid', got {len(row)}")
        cells = [row[0], *row[1].strip().split("-")] if dashed else row
        try:
            values = [int(c) for c in cells]
        except ValueError:
            col = next(k for k, c in enumerate(cells) if not _is_int(c))
            what = "the item id" if col == 0 else f"SID code {col - 1}"
            raise CatalogError(f"{where}: bad integer in {what}") from None
        rows.add(values[0], values[1:], lineno, where)
    return rows, layout


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _resolve_layout(path: str, declared: dict, codebook_sizes, token_offset: int | None):
    """(codebook sizes or None to infer, token offset): the caller's, else the file's, else inferred / 16."""
    file_sizes, file_offset = declared.get("codebook_sizes"), declared.get("token_offset")
    if codebook_sizes is not None and file_sizes is not None and tuple(codebook_sizes) != file_sizes:
        raise CatalogError(f"{path}: file codebook_sizes {file_sizes} differ from requested {tuple(codebook_sizes)}")
    if token_offset is not None and file_offset is not None and token_offset != file_offset:
        raise CatalogError(f"{path}: file token_offset {file_offset} differs from requested {token_offset}")
    sizes = tuple(codebook_sizes) if codebook_sizes is not None else file_sizes
    offset = token_offset if token_offset is not None else file_offset
    return sizes, DEFAULT_TOKEN_OFFSET if offset is None else offset


def _grcat_header(f: BinaryIO, source: str, size: int) -> tuple[int, int, dict, int]:
    """(depth, count, declared layout, payload offset) of a .grcat file; its size must match the header."""
    head = f.read(len(MAGIC) + _HLEN.size)
    if len(head) < len(MAGIC) + _HLEN.size or not head.startswith(MAGIC):
        raise CatalogError(f"{source}: not a .grcat file (bad magic or too short)")
    (hlen,) = _HLEN.unpack_from(head, len(MAGIC))
    body = len(MAGIC) + _HLEN.size + hlen
    if body > size or hlen > MAX_LINE_CHARS:
        raise CatalogError(f"{source}: truncated or oversized header ({hlen} bytes declared)")
    try:
        header = json.loads(f.read(hlen))
        depth, count = _int(header["depth"], "depth"), _int(header["count"], "count")
        declared = _declared_layout({k: header[k] for k in _LAYOUT_KEYS if k in header}, "header")
        sizes = declared["codebook_sizes"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise CatalogError(f"{source}: bad header (expected JSON with integer depth, count and codebook_sizes)") \
            from None
    if depth < 1 or count < 0 or len(sizes) != depth:
        raise CatalogError(f"{source}: inconsistent header (depth {depth}, count {count}, {len(sizes)} codebook "
                           f"sizes)")
    expected = body + count * 8 + count * depth * 4
    if size != expected:
        raise CatalogError(f"{source}: size {size} bytes, expected {expected} for {count} items of depth {depth}")
    return depth, count, declared, body


def _load_grcat(f: BinaryIO, source: str, size: int, codebook_sizes, token_offset: int | None) -> Catalog:
    depth, count, declared, _ = _grcat_header(f, source, size)
    sizes, offset = _resolve_layout(source, declared, codebook_sizes, token_offset)
    ids = np.empty(count, dtype="<i8")
    sids = np.empty((count, depth), dtype="<i4")
    for arr in (ids, sids):  # read straight into the arrays: the file is never held whole as bytes
        if f.readinto(memoryview(arr).cast("B")) != arr.nbytes:  # type: ignore[attr-defined]
            raise CatalogError(f"{source}: truncated payload")
    return Catalog.from_arrays(ids.astype(np.int64), sids.astype(np.int64), sizes, offset, source)


def read_catalog(f: BinaryIO, ext: str, source: str, size: int, *, codebook_sizes=None,
                 token_offset: int | None = None, check: Callable[[], None] | None = None) -> Catalog:
    """Parse an open binary catalog file of format ``ext`` (``.jsonl``, ``.csv``, ``.grcat``) while reading it:
    text formats line by line into compact arrays, ``.grcat`` straight into its arrays (``size``: the file's
    size). Messages name ``source`` and the line, never quote the file's text. ``check()`` is called every few
    thousand lines and may raise to abandon the parse (a deadline)."""
    ext = ext.lower()
    if ext == ".grcat":
        return _load_grcat(f, source, size, codebook_sizes, token_offset)
    if ext not in (".jsonl", ".csv"):
        raise CatalogError(f"{source}: unknown catalog extension {ext!r} (use .jsonl, .csv or .grcat)")
    text = io.TextIOWrapper(f, encoding="utf-8", newline="" if ext == ".csv" else None)
    try:
        rows, declared = (_load_jsonl if ext == ".jsonl" else _load_csv)(text, source, check)
    finally:
        text.detach()
    sizes, offset = _resolve_layout(source, declared, codebook_sizes, token_offset)
    if not len(rows):
        raise CatalogError(f"{source}: catalog is empty")
    ids, sids, lines = rows.arrays()
    return Catalog.from_arrays(ids, sids, sizes, offset, source, lines=lines)


def load_catalog(path, *, codebook_sizes=None, token_offset: int | None = None) -> Catalog:
    """Load a catalog from .jsonl, .csv or .grcat (chosen by extension); the layout is resolved as the module
    docstring says (caller's values, else the file's declaration, else inferred codebook sizes / offset 16)."""
    path = Path(path)
    ext = path.suffix.lower()
    if ext not in (".jsonl", ".csv", ".grcat"):
        raise CatalogError(f"{path}: unknown catalog extension {ext!r} (use .jsonl, .csv or .grcat)")
    with open(path, "rb") as f:
        return read_catalog(f, ext, str(path), os.fstat(f.fileno()).st_size, codebook_sizes=codebook_sizes,
                            token_offset=token_offset)


def save_catalog(catalog: Catalog, path) -> None:
    """Write a catalog as .jsonl, .csv or .grcat (chosen by extension), its layout declared; rows in SID order."""
    path = Path(path)
    ext = path.suffix.lower()
    tmp = path.with_name(path.name + ".tmp")
    ids, sids = catalog.item_ids.tolist(), catalog.sids.tolist()
    sizes, offset = [int(c) for c in catalog.codebook_sizes], int(catalog.layout.token_offset)
    if ext == ".grcat":
        header = json.dumps({"depth": catalog.depth, "codebook_sizes": sizes, "count": len(catalog),
                             "token_offset": offset}).encode()
        with open(tmp, "wb") as f:
            f.write(MAGIC + _HLEN.pack(len(header)) + header)
            f.write(catalog.item_ids.astype("<i8").tobytes())
            f.write(catalog.sids.astype("<i4").tobytes())
    elif ext == ".jsonl":
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({"codebook_sizes": sizes, "token_offset": offset}) + "\n")
            f.writelines(f'{{"item_id": {i}, "sid": {s}}}\n' for i, s in zip(ids, sids))
    elif ext == ".csv":
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(f"# codebook_sizes={','.join(map(str, sizes))}\n# token_offset={offset}\nitem_id,sid\n")
            f.writelines(f"{i},{'-'.join(map(str, s))}\n" for i, s in zip(ids, sids))
    else:
        raise CatalogError(f"{path}: unknown catalog extension {ext!r} (use .jsonl, .csv or .grcat)")
    os.replace(tmp, path)
