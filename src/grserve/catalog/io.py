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
import json
import os
import struct
from pathlib import Path

import numpy as np

from .catalog import Catalog, CatalogError

DEFAULT_TOKEN_OFFSET = 16
MAGIC = b"GRCAT1"
_HLEN = struct.Struct("<I")  # header length after the magic
_LAYOUT_KEYS = ("codebook_sizes", "token_offset")


def _int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CatalogError(f"{where}: expected an integer, got {value!r}")
    return value


def _declared_layout(obj: dict, where: str) -> dict:
    """{"codebook_sizes": tuple, "token_offset": int} from a header object (keys it lacks are left out)."""
    out: dict = {}
    if "codebook_sizes" in obj:
        sizes = obj["codebook_sizes"]
        if not isinstance(sizes, list) or not sizes:
            raise CatalogError(f"{where}: 'codebook_sizes' must be a non-empty list of integers, got {sizes!r}")
        out["codebook_sizes"] = tuple(_int(c, where) for c in sizes)
    if "token_offset" in obj:
        out["token_offset"] = _int(obj["token_offset"], where)
    return out


def _load_jsonl(path: Path):
    ids, sids, lines, layout = [], [], [], {}
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            where = f"{path}: line {lineno}"
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise CatalogError(f"{where}: bad JSON ({e.msg})") from None
            if not ids and not layout and isinstance(obj, dict) and "item_id" not in obj \
                    and any(k in obj for k in _LAYOUT_KEYS):
                layout = _declared_layout(obj, where)  # the optional layout header (first line)
                continue
            if not isinstance(obj, dict) or "item_id" not in obj or "sid" not in obj:
                raise CatalogError(f"{where}: expected an object with 'item_id' and 'sid'")
            sid = obj["sid"]
            if not isinstance(sid, list):
                raise CatalogError(f"{where}: 'sid' must be a list of integers, got {sid!r}")
            ids.append(_int(obj["item_id"], where))
            sids.append([_int(c, where) for c in sid])
            lines.append(lineno)
    return ids, sids, lines, layout


def _csv_comments(lines: list[str], path: Path) -> dict:
    """The layout declared in leading ``# key=value`` comment lines of a CSV catalog."""
    layout: dict = {}
    for lineno, text in enumerate(lines, 1):
        key, eq, value = text.lstrip("#").strip().partition("=")
        key = key.strip()
        if not eq or key not in _LAYOUT_KEYS:
            continue  # a free-text comment
        try:
            numbers = [int(v) for v in value.split(",")]
        except ValueError:
            raise CatalogError(f"{path}: line {lineno}: bad integer in {text.strip()!r}") from None
        layout.update(_declared_layout({key: numbers if key == "codebook_sizes" else numbers[0]},
                                       f"{path}: line {lineno}"))
    return layout


def _load_csv(path: Path):
    ids, sids, lines = [], [], []
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read().splitlines(keepends=True)
    skip = next((k for k, line in enumerate(text) if not line.startswith("#")), len(text))
    layout = _csv_comments(text[:skip], path)
    reader = csv.reader(text[skip:])
    header = [h.strip() for h in next(reader, [])]
    if not header or header[0] != "item_id" or len(header) < 2:
        raise CatalogError(f"{path}: line {skip + 1}: header must be 'item_id,sid' or 'item_id,c1,c2,...'")
    dashed = header == ["item_id", "sid"]
    for row in reader:
        lineno = reader.line_num + skip
        if not any(cell.strip() for cell in row):
            continue
        where = f"{path}: line {lineno}"
        try:
            if dashed:
                if len(row) != 2:
                    raise CatalogError(f"{where}: expected 2 columns 'item_id,sid', got {len(row)}")
                codes = [int(c) for c in row[1].strip().split("-")]
            else:
                codes = [int(c) for c in row[1:]]
            item = int(row[0])
        except ValueError:
            raise CatalogError(f"{where}: bad integer in {','.join(row)!r}") from None
        ids.append(item)
        sids.append(codes)
        lines.append(lineno)
    return ids, sids, lines, layout


def _resolve_layout(path: Path, declared: dict, codebook_sizes, token_offset: int | None):
    """(codebook sizes or None to infer, token offset): the caller's, else the file's, else inferred / 16."""
    file_sizes, file_offset = declared.get("codebook_sizes"), declared.get("token_offset")
    if codebook_sizes is not None and file_sizes is not None and tuple(codebook_sizes) != file_sizes:
        raise CatalogError(f"{path}: file codebook_sizes {file_sizes} differ from requested {tuple(codebook_sizes)}")
    if token_offset is not None and file_offset is not None and token_offset != file_offset:
        raise CatalogError(f"{path}: file token_offset {file_offset} differs from requested {token_offset}")
    sizes = tuple(codebook_sizes) if codebook_sizes is not None else file_sizes
    offset = token_offset if token_offset is not None else file_offset
    return sizes, DEFAULT_TOKEN_OFFSET if offset is None else offset


def _load_grcat(path: Path, codebook_sizes, token_offset: int | None) -> Catalog:
    data = path.read_bytes()
    if len(data) < len(MAGIC) + _HLEN.size or not data.startswith(MAGIC):
        raise CatalogError(f"{path}: not a .grcat file (bad magic or too short)")
    (hlen,) = _HLEN.unpack_from(data, len(MAGIC))
    body = len(MAGIC) + _HLEN.size + hlen
    if body > len(data):
        raise CatalogError(f"{path}: truncated header ({hlen} bytes declared, {len(data) - body + hlen} present)")
    try:
        header = json.loads(data[len(MAGIC) + _HLEN.size:body])
        depth, count = int(header["depth"]), int(header["count"])
        declared = _declared_layout({k: header[k] for k in _LAYOUT_KEYS if k in header}, f"{path}: header")
        sizes = declared["codebook_sizes"]
    except (ValueError, KeyError, TypeError) as e:
        raise CatalogError(f"{path}: bad header ({e})") from None
    if depth < 1 or count < 0 or len(sizes) != depth:
        raise CatalogError(f"{path}: inconsistent header {header}")
    expected = body + count * 8 + count * depth * 4
    if len(data) != expected:
        raise CatalogError(f"{path}: size {len(data)} bytes, expected {expected} for {count} items of depth {depth}")
    sizes, offset = _resolve_layout(path, declared, codebook_sizes, token_offset)
    ids = np.frombuffer(data, dtype="<i8", count=count, offset=body)
    sids = np.frombuffer(data, dtype="<i4", count=count * depth, offset=body + count * 8).reshape(count, depth)
    return Catalog.from_arrays(ids.astype(np.int64), sids.astype(np.int64), sizes, offset, str(path))


def load_catalog(path, *, codebook_sizes=None, token_offset: int | None = None) -> Catalog:
    """Load a catalog from .jsonl, .csv or .grcat (chosen by extension); the layout is resolved as the module
    docstring says (caller's values, else the file's declaration, else inferred codebook sizes / offset 16)."""
    path = Path(path)
    ext = path.suffix.lower()
    if ext == ".grcat":
        return _load_grcat(path, codebook_sizes, token_offset)
    if ext == ".jsonl":
        ids, sids, lines, declared = _load_jsonl(path)
    elif ext == ".csv":
        ids, sids, lines, declared = _load_csv(path)
    else:
        raise CatalogError(f"{path}: unknown catalog extension {ext!r} (use .jsonl, .csv or .grcat)")
    sizes, offset = _resolve_layout(path, declared, codebook_sizes, token_offset)
    return Catalog.from_arrays(ids, sids, sizes, offset, str(path), lines=lines)


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
