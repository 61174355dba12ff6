"""``grserve check precision``: did a lower precision change the recommendations? (issue 42, the recall gate)

The same requests run through the offline API (``Recommender``: the server's conversion, batching and search) twice:
once at float32, the reference, and once at the precision under test (``--dtype``, ``--quantization``). Per request
it compares the two top-N lists and reports, over all requests:

- ``top1``: the fraction whose first item is the same;
- ``overlap@N``: |top-N(reference) ∩ top-N(test)| / N, mean and minimum;
- ``recall@K``: when the input names held-out targets (``"target"``: an item id, or ``"targets"``: a list), the
  fraction of requests with a target among the top K, for both precisions, and its standard error;
- ``max |Δ score|``: over the items both lists hold (summed log-probabilities);
- ``invalid``: items of the test run that are not in the catalog (the trie mask makes it 0; never tolerated).

The input is a JSONL file of ``/v1/recommend`` bodies (``grserve recommend``'s format, the target fields added), or,
without one, ``--users`` sampled histories of catalog items (seeded). It prints a table and one JSON line naming the
machine, and exits 1 when the test precision falls below the gate (``--min-overlap``, ``--min-top1``, any invalid
item), so a deployment script can refuse a precision that changes what users get.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from grserve.flags import Checked, UsageError, add_flags, command_parser, flag, from_args, positive_int

TARGET_FIELDS = ("target", "targets")


@dataclass(frozen=True)
class PrecisionCheck(Checked):
    input: str | None = flag(None, "JSONL of /v1/recommend bodies, each optionally with \"target\" (an item id) or "
                                   "\"targets\" (item ids) held out (default: --users sampled histories)",
                             metavar="FILE")
    users: int = flag(64, "sampled histories when no --input is given", check=positive_int)
    top_n: int = flag(20, "items compared per request (overlap@N)", check=positive_int)
    recall_k: int = flag(10, "K of recall@K against the input's targets", check=positive_int)
    min_overlap: float = flag(0.95, "the gate: mean overlap@N at least this (0 to 1)", metavar="X")
    min_top1: float = flag(0.0, "the gate: top-1 agreement at least this (0 to 1)", metavar="X")
    sample_seed: int = flag(0, "seed of the sampled histories")
    json_only: bool = flag(False, "print only the JSON line")


@dataclass(frozen=True)
class Comparison:
    requests: int
    top1: float
    overlap_mean: float
    overlap_min: float
    max_score_delta: float
    invalid: int
    recall_reference: float | None = None
    recall_test: float | None = None
    recall_stderr: float | None = None
    targets: int = 0

    def passes(self, check: PrecisionCheck) -> bool:
        return self.invalid == 0 and self.overlap_mean >= check.min_overlap and self.top1 >= check.min_top1


def split_targets(body: Any) -> tuple[Any, list[int]]:
    """(the request without its held-out target fields, the targets)."""
    if not isinstance(body, dict):
        return body, []
    targets: list[int] = []
    rest = dict(body)
    for key in TARGET_FIELDS:
        value = rest.pop(key, None)
        if value is not None:
            targets += [int(v) for v in (value if isinstance(value, list) else [value])]
    return rest, targets


def sampled_requests(catalog: Any, n: int, seed: int) -> list[dict]:
    """``n`` histories of 5-20 distinct catalog items (seeded)."""
    rng = np.random.default_rng(seed)
    ids = catalog.item_ids
    return [{"history_items": [int(i) for i in rng.choice(ids, size=int(rng.integers(5, 21)), replace=False)]}
            for _ in range(n)]


def compare(reference: list[Any], test: list[Any], catalog_ids: set[int], top_n: int,
            targets: list[list[int]] | None = None, recall_k: int = 10) -> Comparison:
    """The comparison of two runs' recommendations (``Recommendation`` lists, same order; module docstring)."""
    top1, overlaps, delta, invalid = 0, [], 0.0, 0
    for ref, got in zip(reference, test, strict=True):
        a, b = ref.items[:top_n], got.items[:top_n]
        invalid += sum(it.item_id not in catalog_ids for it in got.items)
        top1 += bool(a) and bool(b) and a[0].item_id == b[0].item_id
        ra, rb = {it.item_id: it.score for it in a}, {it.item_id: it.score for it in b}
        overlaps.append(len(ra.keys() & rb.keys()) / max(len(a), 1))
        common = [abs(ra[i] - rb[i]) for i in ra.keys() & rb.keys() if math.isfinite(ra[i]) and math.isfinite(rb[i])]
        delta = max([delta, *common])
    n = len(reference)
    out = Comparison(n, top1 / max(n, 1), float(np.mean(overlaps)) if overlaps else 1.0,
                     float(min(overlaps)) if overlaps else 1.0, delta, invalid)
    if targets and any(targets):
        rows = [(r, g, t) for r, g, t in zip(reference, test, targets) if t]
        hit = lambda rec, t: any(it.item_id in t for it in rec.items[:recall_k])  # noqa: E731
        ref_hits = np.array([hit(r, set(t)) for r, _, t in rows], dtype=float)
        test_hits = np.array([hit(g, set(t)) for _, g, t in rows], dtype=float)
        stderr = float(np.sqrt(ref_hits.mean() * (1 - ref_hits.mean()) / len(rows)))
        out = replace(out, recall_reference=float(ref_hits.mean()), recall_test=float(test_hits.mean()),
                      recall_stderr=stderr, targets=len(rows))
    return out


def run_check(cfg: Any, check: PrecisionCheck) -> tuple[Comparison, dict]:
    """Run the reference (float32) and the configured precision; returns the comparison and the JSON record."""
    from grserve.model.cpu_support import cpu_support
    from grserve.recommender import Recommender

    quantization = getattr(cfg.model, "quantization", "none")
    if cfg.model.dtype == "float32" and quantization == "none":
        raise UsageError("--dtype / --quantization: give the precision to check (e.g. --dtype bfloat16, "
                         "--quantization int8); the reference is float32")
    reference_cfg = replace(cfg, model=replace(cfg.model, dtype="float32", quantization="none"))
    bodies: list[Any] = []
    targets: list[list[int]] = []
    with Recommender(reference_cfg) as ref:
        catalog = ref.catalog
        raw = _read_input(check.input) if check.input else sampled_requests(catalog, check.users, check.sample_seed)
        for body in raw:
            body, t = split_targets(body)
            bodies.append(body)
            targets.append(t)
        want = ref.recommend(bodies, top_n=check.top_n, progress=not check.json_only)
    with Recommender(cfg) as low:
        used = low.dtype_choice  # --dtype auto: what this machine chose (fp32 here compares fp32 with itself)
        quantized = getattr(low.engine.model, "quantized", None)
        got = low.recommend(bodies, top_n=check.top_n, progress=not check.json_only)
    result = compare(want, got, {int(i) for i in catalog.item_ids}, check.top_n, targets, check.recall_k)
    record = {"check": "precision", "model": cfg.model.source, "dtype": used.name, "dtype_asked": cfg.model.dtype,
              "dtype_reason": used.reason, "quantization": quantization,
              "quantization_op": quantized.choice.op if quantized is not None else "", "reference": "float32",
              "beam_width": cfg.search.beam_width, "top_n": check.top_n, **result.__dict__,
              "recall_k": check.recall_k, "passes": result.passes(check),
              "gate": {"min_overlap": check.min_overlap, "min_top1": check.min_top1, "invalid": 0},
              "machine": cpu_support().to_dict()}
    return result, record


def _read_input(path: str) -> list[Any]:
    out = []
    with (sys.stdin if path == "-" else open(path)) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise UsageError(f"--input {path}: line {n} is not valid JSON ({exc.msg})") from None
    if not out:
        raise UsageError(f"--input {path}: no requests")
    return out


def table(result: Comparison, record: dict) -> str:
    quant = f" + {record['quantization']}" if record.get("quantization", "none") != "none" else ""
    rows = [("requests", f"{result.requests}"), ("top-1 agreement", f"{result.top1:.3f}"),
            (f"overlap@{record['top_n']} mean / min", f"{result.overlap_mean:.3f} / {result.overlap_min:.3f}"),
            ("max |Δ score| (common items)", f"{result.max_score_delta:.3g}"), ("invalid items", f"{result.invalid}")]
    if result.recall_reference is not None:
        rows.append((f"recall@{record['recall_k']} fp32 / {record['dtype']}{quant} ({result.targets} with targets)",
                     f"{result.recall_reference:.4f} / {result.recall_test:.4f} (± {result.recall_stderr:.4f})"))
    rows.append(("gate", "passes" if record["passes"] else "FAILS"))
    width = max(len(k) for k, _ in rows)
    asked = f" ({record['dtype_reason']})" if record.get("dtype_asked") == "auto" else ""
    head = f"{record['model']}: {record['dtype']}{asked}{quant} against float32, beam width {record['beam_width']}, " \
           f"on {record['machine']['cpu']}"
    return "\n".join([head, *(f"  {k:<{width}}  {v}" for k, v in rows)])


def add_command(sub) -> None:
    from grserve.config import ServeConfig

    p = command_parser(sub, "precision", help="compare a lower precision's recommendations with float32's (the "
                                              "recall gate)", description=__doc__)
    d = ServeConfig()
    add_flags(p, PrecisionCheck, title="the check")
    add_flags(p, d.model, title="model (--dtype: the precision checked; auto: the one this machine would serve)")
    add_flags(p, d.catalog, title="catalog (default: a generated one, as grserve serve's)")
    add_flags(p, d.search, title="search")
    p.set_defaults(handler=lambda ns: main(ns))


def main(ns: Any) -> int:
    from grserve.config import CatalogConfig, ModelConfig, SearchConfig, ServeConfig

    check = from_args(PrecisionCheck, ns)
    if not 0.0 <= check.min_overlap <= 1.0 or not 0.0 <= check.min_top1 <= 1.0:
        raise UsageError("--min-overlap / --min-top1: a fraction from 0 to 1")
    cfg = ServeConfig(model=from_args(ModelConfig, ns), catalog=from_args(CatalogConfig, ns),
                      search=from_args(SearchConfig, ns, max_beam_width=max(ns.max_beam_width, ns.beam_width)))
    if cfg.search.beam_width < check.top_n:
        raise UsageError(f"--top-n {check.top_n} is more than --beam-width {cfg.search.beam_width}")
    result, record = run_check(cfg, check)
    if not check.json_only:
        print(table(result, record), file=sys.stderr)
    print(json.dumps(record))
    return 0 if record["passes"] else 1
