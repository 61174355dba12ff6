"""Catalog files: .jsonl, .csv and the compact binary .grcat."""

from __future__ import annotations

import csv
import json
import os
import struct
from pathlib import Path

import numpy as np

from .catalog import Catalog, CatalogError

MAGIC = b"GRCAT1"
_HLEN = struct.Struct("<I")  # header length after the magic


def _int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CatalogError(f"{where}: expected an integer, got {value!r}")
    return value


def _load_jsonl(path: Path):
    ids, sids, lines = [], [], []
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            where = f"{path}: line {lineno}"
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise CatalogError(f"{where}: bad JSON ({e.msg})") from None
            if not isinstance(obj, dict) or "item_id" not in obj or "sid" not in obj:
                raise CatalogError(f"{where}: expected an object with 'item_id' and 'sid'")
            sid = obj["sid"]
            if not isinstance(sid, list):
                raise CatalogError(f"{where}: 'sid' must be a list of integers, got {sid!r}")
            ids.append(_int(obj["item_id"], where))
            sids.append([_int(c, where) for c in sid])
            lines.append(lineno)
    return ids, sids, lines


def _load_csv(path: Path):
    ids, sids, lines = [], [], []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        if not header or header[0] != "item_id" or len(header) < 2:
            raise CatalogError(f"{path}: line 1: header must be 'item_id,sid' or 'item_id,c1,c2,...'")
        dashed = header == ["item_id", "sid"]
        for row in reader:
            lineno = reader.line_num
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
    return ids, sids, lines


def _load_grcat(path: Path, codebook_sizes, token_offset: int) -> Catalog:
    data = path.read_bytes()
    if len(data) < len(MAGIC) + _HLEN.size or not data.startswith(MAGIC):
        raise CatalogError(f"{path}: not a .grcat file (bad magic or too short)")
    (hlen,) = _HLEN.unpack_from(data, len(MAGIC))
    body = len(MAGIC) + _HLEN.size + hlen
    if body > len(data):
        raise CatalogError(f"{path}: truncated header ({hlen} bytes declared, {len(data) - body + hlen} present)")
    try:
        header = json.loads(data[len(MAGIC) + _HLEN.size:body])
        depth, sizes, count = int(header["depth"]), tuple(int(c) for c in header["codebook_sizes"]), int(header["count"])
    except (ValueError, KeyError, TypeError) as e:
        raise CatalogError(f"{path}: bad header ({e})") from None
    if depth < 1 or count < 0 or len(sizes) != depth:
        raise CatalogError(f"{path}: inconsistent header {header}")
    expected = body + count * 8 + count * depth * 4
    if len(data) != expected:
        raise CatalogError(f"{path}: size {len(data)} bytes, expected {expected} for {count} items of depth {depth}")
    if codebook_sizes is not None and tuple(codebook_sizes) != sizes:
        raise CatalogError(f"{path}: file codebook_sizes {sizes} differ from requested {tuple(codebook_sizes)}")
    ids = np.frombuffer(data, dtype="<i8", count=count, offset=body)
    sids = np.frombuffer(data, dtype="<i4", count=count * depth, offset=body + count * 8).reshape(count, depth)
    return Catalog.from_arrays(ids.astype(np.int64), sids.astype(np.int64), sizes, token_offset, str(path))


def load_catalog(path, *, codebook_sizes=None, token_offset: int = 16) -> Catalog:
    """Load a catalog from .jsonl, .csv or .grcat (chosen by extension)."""
    path = Path(path)
    ext = path.suffix.lower()
    if ext == ".grcat":
        return _load_grcat(path, codebook_sizes, token_offset)
    if ext == ".jsonl":
        ids, sids, lines = _load_jsonl(path)
    elif ext == ".csv":
        ids, sids, lines = _load_csv(path)
    else:
        raise CatalogError(f"{path}: unknown catalog extension {ext!r} (use .jsonl, .csv or .grcat)")
    return Catalog.from_arrays(ids, sids, codebook_sizes, token_offset, str(path), lines=lines)


def save_catalog(catalog: Catalog, path) -> None:
    """Write a catalog as .jsonl, .csv or .grcat (chosen by extension); rows in SID order."""
    path = Path(path)
    ext = path.suffix.lower()
    tmp = path.with_name(path.name + ".tmp")
    ids, sids = catalog.item_ids.tolist(), catalog.sids.tolist()
    if ext == ".grcat":
        header = json.dumps({"depth": catalog.depth, "codebook_sizes": list(catalog.codebook_sizes),
                             "count": len(catalog)}).encode()
        with open(tmp, "wb") as f:
            f.write(MAGIC + _HLEN.pack(len(header)) + header)
            f.write(catalog.item_ids.astype("<i8").tobytes())
            f.write(catalog.sids.astype("<i4").tobytes())
    elif ext == ".jsonl":
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(f'{{"item_id": {i}, "sid": {s}}}\n' for i, s in zip(ids, sids))
    elif ext == ".csv":
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("item_id,sid\n")
            f.writelines(f"{i},{'-'.join(map(str, s))}\n" for i, s in zip(ids, sids))
    else:
        raise CatalogError(f"{path}: unknown catalog extension {ext!r} (use .jsonl, .csv or .grcat)")
    os.replace(tmp, path)
