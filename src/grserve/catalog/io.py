"""Catalog files: .jsonl, .csv, the LC-Rec / MiniOneRec index .json and the compact binary .grcat, and the one
loader every path uses.

A catalog maps item ids to SIDs; its *layout* says which model tokens a SID becomes (``SidLayout``): arithmetic
(``codebook_sizes`` + ``token_offset``, the models grserve trains) or tokenizer-native (the SIDs are added tokens of
the model's tokenizer; ``catalog/sid_text.py``). A file should carry its layout:

- ``.jsonl``: an optional header line, then one item per line, either ``{"item_id": 7, "sid": [12, 0, 255]}``
  (codes) or ``{"item_id": 7, "sid_tokens": ["<a_12>", "<b_0>", "<c_255>"]}`` (token strings; one form per file).
  The header may hold ``codebook_sizes`` and ``token_offset`` (arithmetic), or, for codes written as tokens,
  ``sid_token_templates`` (``["<s_a_{}>", "<s_b_{}>", "<s_c_{}>"]``: code c of level l is template l with c in the
  braces) or ``sid_token_vocab`` (per level, the string of each code), and ``sid_begin`` / ``sid_end`` (the tokens
  that wrap an item in a prompt, e.g. ``"<|sid_begin|>"``);
- ``.json``: the LC-Rec / MiniOneRec item index as is, ``{"7": ["<a_12>", "<b_0>", "<c_255>"], ...}`` (keys: integer
  item ids);
- ``.csv``: optional leading comment lines ``# codebook_sizes=256,256,256`` and ``# token_offset=16``, then the
  header ``item_id,sid`` (SIDs written ``12-0-255``) or ``item_id,c1,c2,...`` and one row per item;
- ``.grcat``: ``GRCAT1``, a little-endian u32 header length, a JSON header ``{"depth", "codebook_sizes", "count",
  "token_offset"}`` (``token_offset`` optional; the SID-text keys of the jsonl header allowed), then ``count`` int64
  item ids and ``count x depth`` int32 codes. Rows written by ``save_catalog`` are in SID order (``"sorted": true``),
  so loading skips the sort.

Token strings become codes on load (a level whose strings read ``prefix<int>suffix`` keeps the integers as codes;
otherwise code = rank among the level's strings) and the catalog keeps its ``text``; the strings are resolved against
the model's tokenizer when a server binds the catalog (``sid_text.bind_catalog``).

``load_catalog`` resolves the arithmetic layout the same way for every caller (start-up and ``POST /v1/catalog``
alike): codebook sizes the caller gives, else the file's declared ones, else inferred from the file (``max code + 1``
per level — only right when every code of the last value of each level occurs: declare them); the token offset the
caller gives, else the file's, else 16. A caller's value that contradicts the file's declaration is an error.
``save_catalog`` always writes the layout (and the SID text, when the catalog has one).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import struct
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TextIO

import numpy as np

from .catalog import Catalog
from .errors import CatalogError
from .sid_text import SidText, codes_from_strings, parse_header, text_from_header

DEFAULT_TOKEN_OFFSET = 16
MAGIC = b"GRCAT1"
_HLEN = struct.Struct("<I")  # header length after the magic
_LAYOUT_KEYS = ("codebook_sizes", "token_offset")
_TEXT_KEYS = ("sid_token_templates", "sid_token_vocab", "sid_begin", "sid_end")
EXTENSIONS = (".jsonl", ".csv", ".grcat", ".json")
MAX_HEADER_BYTES = 16 << 20  # a .grcat header with a SID token vocabulary (8,192 × 4 strings: ~0.4 MB)


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
    text = parse_header(obj, where)
    if text:
        out["text"] = text
    return out


class _Rows:
    """Item ids, SIDs and line numbers, accumulated compactly: codes as int64 arrays (not Python lists), or token
    strings per level (``sid_tokens``); the form and the SID depth are fixed by the first row."""

    def __init__(self) -> None:
        self.ids, self.codes, self.lines = array("q"), array("q"), array("q")
        self.strings: list[list[str]] | None = None  # token rows: one list per level
        self.depth: int | None = None

    def _start(self, item: int, n: int, tokens: bool, lineno: int, where: str, shown: str) -> None:
        if self.depth is None:
            self.depth = n
            self.strings = [[] for _ in range(n)] if tokens else None
        if tokens != (self.strings is not None):
            raise CatalogError(f"{where}: items give 'sid' and 'sid_tokens' (one form per file)")
        if n != self.depth or not n:
            raise CatalogError(f"{where}: {shown} has depth {n}, expected {self.depth} (from the first item)")
        try:
            self.ids.append(item)
        except OverflowError:
            raise CatalogError(f"{where}: an integer is outside the int64 range") from None
        self.lines.append(lineno)

    def add(self, item: int, sid: list[int], lineno: int, where: str) -> None:
        self._start(item, len(sid), False, lineno, where, f"SID {tuple(sid)}")
        try:
            self.codes.extend(sid)
        except OverflowError:
            raise CatalogError(f"{where}: an integer is outside the int64 range") from None

    def add_tokens(self, item: int, tokens: list[str], lineno: int, where: str) -> None:
        self._start(item, len(tokens), True, lineno, where, "the SID in sid_tokens")
        for column, t in zip(self.strings, tokens):  # type: ignore[arg-type]
            column.append(t)

    def __len__(self) -> int:
        return len(self.ids)

    def arrays(self, declared: dict, source: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, SidText | None]:
        """(item ids, [n, depth] codes, line numbers, the SID text the rows or the header give)."""
        n = len(self.ids)
        ids, lines = np.frombuffer(self.ids, dtype=np.int64), np.frombuffer(self.lines, dtype=np.int64)
        text_decl = declared.get("text", {})
        if self.strings is not None:
            sids, text = codes_from_strings([np.asarray(c, dtype=str) for c in self.strings], text_decl, source)
            return ids, sids, lines, text
        sids = np.frombuffer(self.codes, dtype=np.int64).reshape(n, self.depth or 0) if n else \
            np.zeros((0, 1), dtype=np.int64)
        return ids, sids, lines, text_from_header(text_decl, sids.shape[1], source)


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


def _token_list(value, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise CatalogError(f"{where}: 'sid_tokens' must be a list of non-empty strings")
    return value


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
                and any(k in obj for k in _LAYOUT_KEYS + _TEXT_KEYS):
            layout = _declared_layout(obj, where)  # the optional layout header (first line)
            continue
        if not isinstance(obj, dict) or "item_id" not in obj or ("sid" in obj) == ("sid_tokens" in obj):
            raise CatalogError(f"{where}: expected an object with 'item_id' and either 'sid' or 'sid_tokens'")
        if "sid_tokens" in obj:
            rows.add_tokens(_int(obj["item_id"], where), _token_list(obj["sid_tokens"], where), lineno, where)
            continue
        sid = obj["sid"]
        if not isinstance(sid, list):
            raise CatalogError(f"{where}: 'sid' must be a list of integers, got a JSON {_json_kind(sid)}")
        rows.add(_int(obj["item_id"], where), [_int(c, where) for c in sid], lineno, where)
    return rows, layout


_INT_KEY = re.compile(r"-?[0-9]{1,19}")


def _load_index(f: TextIO, source: str, check: Callable[[], None] | None = None):
    """The LC-Rec / MiniOneRec index ``{"<item id>": ["<a_1>", "<b_2>", ...], ...}``; entry k stands for line k."""
    try:
        obj = json.load(f)
    except json.JSONDecodeError as e:
        raise CatalogError(f"{source}: bad JSON ({e.msg}, line {e.lineno})") from None
    except (RecursionError, UnicodeDecodeError):
        raise CatalogError(f"{source}: bad JSON (not UTF-8 or nested too deeply)") from None
    if not isinstance(obj, dict):
        raise CatalogError(f"{source}: expected an object mapping item ids to lists of SID token strings")
    rows = _Rows()
    for k, (key, tokens) in enumerate(obj.items(), start=1):
        where = f"{source}: entry {k}"
        if not _INT_KEY.fullmatch(key):
            raise CatalogError(f"{where}: the key is not an integer item id")
        rows.add_tokens(int(key), _token_list(tokens, where), k, where)
        if check is not None and k % 4096 == 0:
            check()
    return rows, {}


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
    if body > size or hlen > MAX_HEADER_BYTES:
        raise CatalogError(f"{source}: truncated or oversized header ({hlen} bytes declared)")
    try:
        header = json.loads(f.read(hlen))
        depth, count = _int(header["depth"], "depth"), _int(header["count"], "count")
        declared = _declared_layout({k: header[k] for k in _LAYOUT_KEYS + _TEXT_KEYS if k in header}, "header")
        sizes = declared["codebook_sizes"]
        declared["sorted"] = header.get("sorted") is True
    except CatalogError as exc:
        raise CatalogError(f"{source}: bad header ({str(exc).removeprefix('header: ')})") from None
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


def _load_grcat(f: BinaryIO, source: str, size: int, codebook_sizes, token_offset: int | None,
                duplicate_sids: str = "refuse") -> Catalog:
    depth, count, declared, _ = _grcat_header(f, source, size)
    sizes, offset = _resolve_layout(source, declared, codebook_sizes, token_offset)
    ids = np.empty(count, dtype="<i8")
    sids = np.empty((count, depth), dtype="<i4")
    for arr in (ids, sids):  # read straight into the arrays: the file is never held whole as bytes
        if f.readinto(memoryview(arr).cast("B")) != arr.nbytes:  # type: ignore[attr-defined]
            raise CatalogError(f"{source}: truncated payload")
    text = text_from_header(declared.get("text", {}), depth, source)
    return Catalog.from_arrays(ids, sids, sizes, offset, source, text=text, declared=_declares(declared),
                               presorted=declared["sorted"], duplicate_sids=duplicate_sids)


def _declares(declared: dict) -> bool:
    """The file declares its layout: a token offset, or SID text (no tokenizer inference then)."""
    return "token_offset" in declared or "text" in declared


def read_catalog(f: BinaryIO, ext: str, source: str, size: int, *, codebook_sizes=None,
                 token_offset: int | None = None, check: Callable[[], None] | None = None,
                 duplicate_sids: str = "refuse") -> Catalog:
    """Parse an open binary catalog file of format ``ext`` (``.jsonl``, ``.csv``, ``.json``, ``.grcat``) while
    reading it: text formats line by line into compact arrays, ``.grcat`` straight into its arrays (``size``: the
    file's size). Messages name ``source`` and the line, never quote the file's text. ``check()`` is called every
    few thousand lines and may raise to abandon the parse (a deadline). ``duplicate_sids``: ``catalog/duplicates.py``."""
    ext = ext.lower()
    if ext == ".grcat":
        return _load_grcat(f, source, size, codebook_sizes, token_offset, duplicate_sids)
    if ext not in EXTENSIONS:
        raise CatalogError(f"{source}: unknown catalog extension {ext!r} (use {', '.join(EXTENSIONS)})")
    text = io.TextIOWrapper(f, encoding="utf-8", newline="" if ext == ".csv" else None)
    try:
        parse = {".jsonl": _load_jsonl, ".csv": _load_csv, ".json": _load_index}[ext]
        rows, declared = parse(text, source, check)
    finally:
        text.detach()
    sizes, offset = _resolve_layout(source, declared, codebook_sizes, token_offset)
    if not len(rows):
        raise CatalogError(f"{source}: catalog is empty")
    ids, sids, lines, sid_text = rows.arrays(declared, source)
    return Catalog.from_arrays(ids, sids, sizes, offset, source, lines=lines, text=sid_text,
                               declared=_declares(declared) or sid_text is not None, duplicate_sids=duplicate_sids,
                               unit="entry" if ext == ".json" else "line")


def load_catalog(path, *, codebook_sizes=None, token_offset: int | None = None,
                 duplicate_sids: str = "refuse") -> Catalog:
    """Load a catalog from .jsonl, .csv, .json (an LC-Rec index) or .grcat (chosen by extension); the layout is
    resolved as the module docstring says (caller's values, else the file's declaration, else inferred codebook
    sizes / offset 16). A catalog with SID text is bound to a tokenizer later (``sid_text.bind_catalog``)."""
    path = Path(path)
    ext = path.suffix.lower()
    if ext not in EXTENSIONS:
        raise CatalogError(f"{path}: unknown catalog extension {ext!r} (use {', '.join(EXTENSIONS)})")
    with open(path, "rb") as f:
        return read_catalog(f, ext, str(path), os.fstat(f.fileno()).st_size, codebook_sizes=codebook_sizes,
                            token_offset=token_offset, duplicate_sids=duplicate_sids)


def _header(catalog: Catalog) -> dict:
    out = {"codebook_sizes": [int(c) for c in catalog.codebook_sizes]}
    if catalog.text is not None:
        out.update(catalog.text.header())
    else:
        out["token_offset"] = int(catalog.layout.token_offset)
    return out


def write_grcat(catalog: Catalog, f: BinaryIO) -> None:
    """A catalog as ``.grcat`` bytes (its layout and SID text declared; rows in SID order) into ``f``."""
    ids, sids = catalog.all_items()
    head = json.dumps({"depth": catalog.depth, "count": int(ids.size), "sorted": True, **_header(catalog)}).encode()
    f.write(MAGIC + _HLEN.pack(len(head)) + head)
    f.write(ids.astype("<i8").tobytes())
    f.write(sids.astype("<i4").tobytes())


def save_catalog(catalog: Catalog, path) -> None:
    """Write a catalog as .jsonl, .csv, .json (an LC-Rec index; SID text needed) or .grcat (chosen by extension),
    its layout declared (its SID text too, which .csv cannot carry); rows in SID order."""
    path = Path(path)
    ext = path.suffix.lower()
    if ext not in EXTENSIONS:
        raise CatalogError(f"{path}: unknown catalog extension {ext!r} (use {', '.join(EXTENSIONS)})")
    if (ext == ".csv" and catalog.text is not None) or (ext == ".json" and catalog.text is None):
        raise CatalogError(f"{path}: {'.csv cannot carry' if ext == '.csv' else '.json needs'} SID token text "
                           "(use .jsonl or .grcat)")
    tmp = path.with_name(path.name + ".tmp")
    header = _header(catalog)
    if ext == ".grcat":
        with open(tmp, "wb") as f:
            write_grcat(catalog, f)
    elif ext == ".json":
        all_ids, all_sids = catalog.all_items()
        strings = [catalog.text.strings(level, all_sids[:, level]) for level in range(catalog.depth)]
        index = {str(i): [col[r] for col in strings] for r, i in enumerate(all_ids.tolist())}
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(index, f)
    else:
        all_ids, all_sids = catalog.all_items()
        ids, sids = all_ids.tolist(), all_sids.tolist()
        with open(tmp, "w", encoding="utf-8") as f:
            if ext == ".jsonl":
                f.write(json.dumps(header) + "\n")
                f.writelines(f'{{"item_id": {i}, "sid": {s}}}\n' for i, s in zip(ids, sids))
            else:
                sizes, offset = header["codebook_sizes"], header["token_offset"]
                f.write(f"# codebook_sizes={','.join(map(str, sizes))}\n# token_offset={offset}\nitem_id,sid\n")
                f.writelines(f"{i},{'-'.join(map(str, s))}\n" for i, s in zip(ids, sids))
    os.replace(tmp, path)
