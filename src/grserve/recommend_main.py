"""``grserve recommend``: offline batch recommendation, JSONL in, JSONL out (the offline API on the command line).

    grserve recommend --model DIR --catalog FILE --input users.jsonl --output recs.jsonl --beam-width 100 --top-n 20

Each input line is a ``/v1/recommend`` body (``{"history_items": [...]}``, ``history_sids``, ``history_tokens``,
``top_n``, ``beam_width``, ``exclude_items``, ``request_id``), optionally with a ``user_id`` (any JSON value, echoed),
or a bare JSON array of item ids. Blank lines are skipped. Each output line, in input order:
``{"line": N, "user_id": ..., "request_id": ..., "items": [{"item_id", "sid", "score"}, ...], "source": "model",
"history_dropped": 0}`` (``user_id`` and ``request_id`` only when the input gave them; ``source`` "popularity": a
cold start, answered from the popularity order; ``thinking`` when the request thought). The run streams: inputs are read as the engine needs them and
outputs written as they finish (memory bounded by the read-ahead window, not the file). A bad line (not JSON, or a
request the server would refuse) stops the run with its line number and the reason, or with ``--skip-bad-lines``
is reported, counted and left out. Batching, scoring and results are those of ``grserve serve`` with the same
flags (``grserve.recommender``); ``-`` reads stdin / writes stdout.
"""

from __future__ import annotations

import json
import sys
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

from grserve.config import AccelConfig, BeamApiConfig, CatalogConfig, ModelConfig, SchedulerConfig, SearchConfig, \
    ServeConfig, ServerConfig
from grserve.flags import Checked, UsageError, add_flags, command_parser, flag, from_args, positive_int

CATALOG_SKIP = ("num_items", "depth", "codebook_size", "seed")
SERVER_SKIP = ("host", "port", "log_level")
BEAMS_SKIP = ("served_model_name",)


@dataclass(frozen=True)
class RecommendIO(Checked):
    input: str = flag(help="JSONL file of requests, one per line ('-': stdin)", metavar="FILE")
    output: str = flag(help="JSONL file of results, one per input line in order ('-': stdout)", metavar="FILE")
    top_n: int = flag(10, "items per user, where a line does not give its own top_n", check=positive_int)
    skip_bad_lines: bool = flag(False, "report, count and skip a bad input line instead of stopping at it")
    progress: bool = flag(True, "progress bar with users/s (stderr)")


def add_command(sub) -> None:
    p = command_parser(sub, "recommend", help="offline batch recommendation: JSONL requests in, JSONL items out",
                       description=__doc__)
    d = ServeConfig()
    add_flags(p, RecommendIO, title="input and output")
    add_flags(p, d.model, title="model")
    add_flags(p, d.catalog, title="catalog", skip=CATALOG_SKIP)
    add_flags(p, d.search, title="search")
    add_flags(p, d.scheduler, title="batching")
    add_flags(p, d.server, title="request limits (as the server's)", skip=SERVER_SKIP)
    add_flags(p, d.accel, title="accelerator (docs/gpu.md)")
    add_flags(p, d.beams, title="prompts (as the server's)", skip=BEAMS_SKIP)
    p.set_defaults(handler=lambda ns: run(config_from_args(ns), from_args(RecommendIO, ns)))


def config_from_args(ns) -> ServeConfig:
    return ServeConfig(model=from_args(ModelConfig, ns), catalog=from_args(CatalogConfig, ns),
                       search=from_args(SearchConfig, ns, max_beam_width=max(ns.max_beam_width, ns.beam_width)),
                       scheduler=from_args(SchedulerConfig, ns), server=from_args(ServerConfig, ns),
                       accel=from_args(AccelConfig, ns), beams=from_args(BeamApiConfig, ns))


class BadLine(Exception):
    def __init__(self, line: int, message: str):
        super().__init__(f"line {line}: {message}")
        self.line, self.message = line, message


class _Lines:
    """The input's requests, parsed lazily; the line number and echoed fields of each request not yet answered
    (FIFO: answers and refusals both come in input order)."""

    def __init__(self, f, skip: bool, report):
        self.f, self.skip, self.report = f, skip, report
        self.pending: deque[tuple[int, dict]] = deque()
        self.bad = 0

    def __iter__(self):
        for n, text in enumerate(self.f, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                self.refuse(n, f"not valid JSON: {exc.msg} at column {exc.colno}")
                continue
            echo = {}
            if isinstance(obj, dict):
                obj = dict(obj)
                if "user_id" in obj:
                    echo["user_id"] = obj.pop("user_id")
                if "request_id" in obj:
                    echo["request_id"] = obj["request_id"]
            self.pending.append((n, echo))
            yield obj

    def refuse(self, line: int, message: str) -> None:
        if not self.skip:
            raise BadLine(line, message)
        self.bad += 1
        self.report(f"skipped line {line}: {message}")

    def on_error(self, index: int, exc) -> None:
        line, _ = self.pending.pop()  # the request just read is the one refused
        self.refuse(line, exc.message)


def output_line(line: int, echo: dict, rec) -> dict:
    """One output line: the input's line number and echoed ids, the items, where they came from (``source``:
    "model", or "popularity" for a cold start), the history entries ``truncate`` cut, the thought if any."""
    out = {"line": line, **echo, **{k: v for k, v in rec.to_dict().items() if k in ANSWER_FIELDS}}
    if rec.thinking is None:
        del out["thinking"]
    return out


ANSWER_FIELDS = ("items", "source", "history_dropped", "thinking")


@contextmanager
def _open(path: str, mode: str):
    if path == "-":
        yield sys.stdin if "r" in mode else sys.stdout
        return
    with open(path, mode, encoding="utf-8") as f:
        yield f


def run(cfg: ServeConfig, io: RecommendIO) -> int:
    import os

    if cfg.catalog.path is None:
        raise UsageError("--catalog FILE is required (the catalog the model was trained with)")
    for path, what in ((cfg.catalog.path, "catalog"), (io.input, "input")):
        if path != "-" and not os.path.isfile(path):
            raise UsageError(f"{what} file not found: {path}")
    from grserve.recommender import Recommender

    try:
        rec = Recommender(cfg)
    except (ValueError, KeyError, OSError) as exc:
        raise UsageError(str(exc)) from None
    report = lambda msg: print(f"grserve recommend: {msg}", file=sys.stderr, flush=True)
    if io.progress and rec.dtype_choice is not None:
        from grserve.model.precision_label import model_label  # lazy: torch

        report(f"model {cfg.model.source} ({model_label(rec.engine.model, cfg.model)})")
    written = 0
    with rec, _open(io.input, "r") as fin, _open(io.output, "w") as fout:
        lines = _Lines(fin, io.skip_bad_lines, report)
        try:
            for r in rec.stream(lines, top_n=io.top_n, progress=io.progress, on_error=lines.on_error):
                line, echo = lines.pending.popleft()
                fout.write(json.dumps(output_line(line, echo, r)) + "\n")
                written += 1
        except BadLine as exc:
            report(f"{io.input}: {exc} (--skip-bad-lines skips such lines)")
            return 1
    report(f"{written} users written to {io.output}" + (f"; {lines.bad} bad lines skipped" if lines.bad else ""))
    return 0
