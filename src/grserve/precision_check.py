"""``grserve check precision``: did a lower precision change the recommendations? (issue 42, the recall gate)

The same requests run through the offline API (``Recommender``: the server's conversion, batching and search) twice:
once at float32, the reference, and once at the precision under test (``--dtype``, ``--quantization``). Per request
it compares the two top-N lists and reports, over all requests:

- ``top1``: the fraction whose first item is the same;
- ``overlap@N``: |top-N(reference) ∩ top-N(test)| / N, mean and minimum;
- ``recall@K``: when the input names held-out targets (``"target"``: an item id, or ``"targets"``: a list), the
  fraction of requests with a target among the top K (= HR@K; one target per request in a leave-one-out split),
  and ``ndcg@K`` (DCG of the targets' ranks over the ideal DCG), for both precisions, each with the reference's
  standard error and whether the test precision lies within one of it;
- ``max |Δ score|``: over the items both lists hold (summed log-probabilities);
- ``invalid``: items of the test run that are not in the catalog (the trie mask makes it 0; never tolerated).

The input is a JSONL file of ``/v1/recommend`` bodies (``grserve recommend``'s format, the target fields added);
``--dataset movielens|beauty``: the held-out split of a model this repository trains (the cached model and catalog
of ``python -m grserve.demo`` / ``grserve bench quality --dataset beauty``; every user's most recent items before
the ``--split`` item as the history, that item the target; ``--save-input`` writes those requests as JSONL); or,
without either, ``--users`` sampled histories of catalog items (seeded). It prints a table and one JSON line naming the
machine, and exits 1 when the test precision falls below the gate (``--min-overlap``, ``--min-top1``, any invalid
item), so a deployment script can refuse a precision that changes what users get.

``startup_gate`` is the same check inside ``grserve serve --precision-gate-users N`` (``PrecisionGateConfig``): N
sampled histories before the server is built; below the gate the server falls back to float32, saying so on its
start line, or refuses to start.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from grserve.flags import Checked, UsageError, add_flags, command_parser, flag, from_args, positive_int

TARGET_FIELDS = ("target", "targets")
DATASETS = ("movielens", "beauty")


@dataclass(frozen=True)
class PrecisionCheck(Checked):
    input: str | None = flag(None, "JSONL of /v1/recommend bodies, each optionally with \"target\" (an item id) or "
                                   "\"targets\" (item ids) held out (default: --users sampled histories)",
                             metavar="FILE")
    dataset: str | None = flag(None, "the held-out split of a model this repository trains, as the input: the cached "
                                     "model and catalog (unless --model / --catalog are given) and every user's "
                                     "history with the --split item as its target", choices=DATASETS)
    split: str = flag("test", "--dataset: which held-out item is the target", choices=("test", "valid"))
    max_users: int | None = flag(None, "--dataset: at most this many users, spread evenly over the split (default: "
                                       "all)", check=positive_int, metavar="N")
    cache_dir: str | None = flag(None, "--dataset: its artifact directory (default: $GRSERVE_CACHE_DIR/<dataset> or "
                                       ".grserve-cache/<dataset>)", metavar="DIR")
    save_input: str | None = flag(None, "write the requests checked (with their targets) to this JSONL file",
                                  metavar="FILE")
    users: int = flag(64, "sampled histories when neither --input nor --dataset is given", check=positive_int)
    top_n: int = flag(20, "items compared per request (overlap@N)", check=positive_int)
    recall_k: int = flag(10, "K of recall@K (HR@K) and NDCG@K against the input's targets", check=positive_int)
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
    ndcg_reference: float | None = None
    ndcg_test: float | None = None
    ndcg_stderr: float | None = None
    targets: int = 0

    def passes(self, check: PrecisionCheck) -> bool:
        return self.invalid == 0 and self.overlap_mean >= check.min_overlap and self.top1 >= check.min_top1

    @property
    def recall_within_stderr(self) -> bool | None:
        """|recall(test) - recall(reference)| <= one standard error of the reference's (None: no targets)."""
        if self.recall_reference is None:
            return None
        return abs(self.recall_test - self.recall_reference) <= self.recall_stderr + 1e-12

    @property
    def ndcg_within_stderr(self) -> bool | None:
        if self.ndcg_reference is None:
            return None
        return abs(self.ndcg_test - self.ndcg_reference) <= self.ndcg_stderr + 1e-12

    def to_dict(self) -> dict:
        return {**self.__dict__, "recall_within_stderr": self.recall_within_stderr,
                "ndcg_within_stderr": self.ndcg_within_stderr}


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
        ref_gain = np.array([ndcg(r, set(t), recall_k) for r, _, t in rows])
        test_gain = np.array([ndcg(g, set(t), recall_k) for _, g, t in rows])
        out = replace(out, recall_reference=float(ref_hits.mean()), recall_test=float(test_hits.mean()),
                      recall_stderr=_stderr(ref_hits), ndcg_reference=float(ref_gain.mean()),
                      ndcg_test=float(test_gain.mean()), ndcg_stderr=_stderr(ref_gain), targets=len(rows))
    return out


def ndcg(rec: Any, targets: set[int], k: int) -> float:
    """DCG of the targets among the top ``k`` (gain 1 / log2(rank + 2), rank 0-based) over the ideal DCG."""
    dcg = sum(1.0 / math.log2(r + 2) for r, it in enumerate(rec.items[:k]) if it.item_id in targets)
    ideal = sum(1.0 / math.log2(r + 2) for r in range(min(len(targets), k)))
    return dcg / ideal if ideal else 0.0


def _stderr(x: np.ndarray) -> float:
    """The standard error of the mean of per-request values (population variance, as for a proportion)."""
    return float(np.sqrt(x.var() / len(x))) if len(x) else 0.0


def dataset_requests(name: str, split: str = "test", max_users: int | None = None,
                     cache_dir: str | None = None) -> tuple[str, str, list[dict]]:
    """(model dir, catalog file, requests) of a dataset's cached model and its held-out split: per user
    ``{"user_id", "history_items": the most recent items before the split's item, "target": that item}``, the
    history cut to the model's ``max_items`` as its training and ``grserve bench quality`` cut it (MovieLens 50,
    Beauty 20). ``max_users``: that many users spread evenly over the split (every k-th)."""
    if name == "movielens":
        from grserve.movielens.artifacts import Artifacts, ArtifactsConfig
        from grserve.movielens.data import load_movielens
        from grserve.movielens.split import leave_one_out

        art = Artifacts(ArtifactsConfig(cache_dir=cache_dir).root)
        build, default_items = "python -m grserve.demo (or grserve bench quality)", 50
    elif name == "beauty":
        from grserve.beauty.artifacts import BeautyArtifactsConfig
        from grserve.beauty.data import load_sid_dataset
        from grserve.movielens.artifacts import Artifacts

        art = Artifacts(BeautyArtifactsConfig(cache_dir=cache_dir).root)
        build, default_items = "grserve bench quality --dataset beauty", 20
    else:
        raise UsageError(f"--dataset: one of {', '.join(DATASETS)}, got {name!r}")
    if not (art.train_meta.is_file() and art.catalog.is_file()):
        raise UsageError(f"--dataset {name}: no trained model in {art.root} (train it once with {build}; "
                         f"--cache-dir names another folder)")
    meta = json.loads(art.train_meta.read_text())
    max_items = int(meta.get("config", {}).get("max_items", default_items))
    if name == "movielens":
        held_out = leave_one_out(load_movielens(art.root).ratings)
    else:
        held_out = load_sid_dataset(None, meta.get("index", "rqkmeans")).split()
    n = len(held_out.users)
    pick = range(n) if max_users is None or max_users >= n else \
        np.unique(np.linspace(0, n - 1, num=max_users).round().astype(int))
    requests = []
    for i in pick:
        history = held_out.test_history(i) if split == "test" else held_out.train[i]
        target = held_out.test[i] if split == "test" else held_out.valid[i]
        requests.append({"user_id": int(held_out.users[i]), "history_items": [int(x) for x in history[-max_items:]],
                         "target": int(target)})
    return str(art.model), str(art.catalog), requests


def run_check(cfg: Any, check: PrecisionCheck, requests: list[Any] | None = None) -> tuple[Comparison, dict]:
    """Run the reference (float32) and the configured precision; returns the comparison and the JSON record.
    ``requests``: the inputs (default: ``--input``'s, else ``--users`` sampled histories)."""
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
        raw = requests if requests is not None else _read_input(check.input) if check.input else \
            sampled_requests(catalog, check.users, check.sample_seed)
        if check.save_input:  # what was checked, targets included: grserve recommend / check precision --input
            with open(check.save_input, "w") as f:
                f.writelines(json.dumps(body) + "\n" for body in raw)
        for body in raw:
            body, t = split_targets(body)
            bodies.append(body)
            targets.append(t)
        t0 = time.perf_counter()
        want = ref.recommend(bodies, top_n=check.top_n, progress=not check.json_only)
        reference_s = time.perf_counter() - t0
    with Recommender(cfg) as low:
        used = low.dtype_choice  # --dtype auto: what this machine chose (fp32 here compares fp32 with itself)
        quantized = getattr(low.engine.model, "quantized", None)
        t0 = time.perf_counter()
        got = low.recommend(bodies, top_n=check.top_n, progress=not check.json_only)
        test_s = time.perf_counter() - t0
    result = compare(want, got, {int(i) for i in catalog.item_ids}, check.top_n, targets, check.recall_k)
    record = {"check": "precision", "model": cfg.model.source, "dtype": used.name, "dtype_asked": cfg.model.dtype,
              "dtype_reason": used.reason, "quantization": quantization,
              "quantization_op": quantized.choice.op if quantized is not None else "", "reference": "float32",
              "beam_width": cfg.search.beam_width, "top_n": check.top_n, **result.to_dict(),
              "recall_k": check.recall_k, "passes": result.passes(check),
              "gate": {"min_overlap": check.min_overlap, "min_top1": check.min_top1, "invalid": 0},
              "seconds_reference": round(reference_s, 1), "seconds_test": round(test_s, 1),
              "load_avg_1m": round(os.getloadavg()[0], 2), "machine": cpu_support().to_dict()}
    if check.dataset:
        record.update(dataset=check.dataset, split=check.split)
    return result, record


def startup_gate(cfg: Any, log: Any = print) -> Any:
    """``grserve serve --precision-gate-users N``: the check on N sampled histories before the server is built.

    Returns ``cfg`` as it is when the gate is off or the model serves float32 unquantized (nothing to compare); else
    with the gate's verdict in ``cfg.precision_gate.outcome`` (the start line prints it) and, below the gate with
    ``--precision-gate-action fallback``, ``--dtype float32 --quantization none``. Refuses (``UsageError``: exit 2) below the gate with
    ``--precision-gate-action refuse``. ``log`` gets one line saying what was measured."""
    from grserve.model.dtype_choice import choice

    gate = cfg.precision_gate
    if not gate.enabled:
        return cfg
    chosen = choice(cfg.model.dtype, str(cfg.model.device))
    quantization = getattr(cfg.model, "quantization", "none")
    if chosen.name == "float32" and quantization == "none":
        log("precision gate: skipped, the model serves float32 (the reference)")
        return cfg
    top_n = min(gate.precision_gate_top_n, cfg.search.beam_width)
    check = PrecisionCheck(users=gate.precision_gate_users, top_n=top_n, min_overlap=gate.precision_gate_min_overlap,
                           min_top1=gate.precision_gate_min_top1, json_only=True)
    t0 = time.perf_counter()
    result, record = run_check(replace(cfg, search=replace(cfg.search, warmup=False)), check)
    served = record["dtype"] + (f" + {quantization}" if quantization != "none" else "")
    what = (f"{served} vs float32 on {result.requests} sampled histories, beam width "
            f"{cfg.search.beam_width}: overlap@{top_n} {result.overlap_mean:.3f} (min {result.overlap_min:.3f}), "
            f"top-1 {result.top1:.3f}, max |Δ score| {result.max_score_delta:.3g}, {result.invalid} invalid items "
            f"({time.perf_counter() - t0:.1f} s)")
    if result.passes(check):
        log(f"precision gate: {what}: passes")
        verdict = f"precision gate passed: overlap@{top_n} {result.overlap_mean:.3f}, top-1 {result.top1:.3f}"
        return replace(cfg, precision_gate=replace(gate, outcome=verdict))
    why = [f"overlap@{top_n} {result.overlap_mean:.3f} < {check.min_overlap:g}"] \
        if result.overlap_mean < check.min_overlap else []
    why += [f"top-1 {result.top1:.3f} < {check.min_top1:g}"] if result.top1 < check.min_top1 else []
    why += [f"{result.invalid} invalid items"] if result.invalid else []
    if gate.precision_gate_action == "refuse":
        raise UsageError(f"precision gate: {what}: below the gate ({'; '.join(why)}); not serving "
                         f"(--precision-gate-action refuse; fallback would serve float32)")
    log(f"precision gate: {what}: below the gate ({'; '.join(why)}) -> serving float32 instead of {served}")
    verdict = (f"float32, {cfg.model.device}: FELL BACK from {served}, below the precision gate "
               f"({'; '.join(why)})")
    return replace(cfg, model=replace(cfg.model, dtype="float32", quantization="none"),
                   precision_gate=replace(gate, outcome=verdict, fell_back=True))


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
        k, low = record["recall_k"], f"{record['dtype']}{quant}"
        within = lambda ok: "within 1 SE" if ok else "NOT within 1 SE"  # noqa: E731
        rows.append((f"recall@{k} (HR@{k}) fp32 / {low} ({result.targets} with targets)",
                     f"{result.recall_reference:.4f} / {result.recall_test:.4f} (SE {result.recall_stderr:.4f}: "
                     f"{within(result.recall_within_stderr)})"))
        rows.append((f"NDCG@{k} fp32 / {low}", f"{result.ndcg_reference:.4f} / {result.ndcg_test:.4f} (SE "
                                              f"{result.ndcg_stderr:.4f}: {within(result.ndcg_within_stderr)})"))
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
    if check.dataset and check.input:
        raise UsageError("--input and --dataset: give one of them")
    model, catalog = from_args(ModelConfig, ns), from_args(CatalogConfig, ns)
    requests = None
    if check.dataset:
        model_dir, catalog_path, requests = dataset_requests(check.dataset, check.split, check.max_users,
                                                             check.cache_dir)
        if model.source == ModelConfig().source:  # not given: the dataset's cached model
            model = replace(model, source=model_dir)
        if catalog.path is None:
            catalog = replace(catalog, path=catalog_path)
    cfg = ServeConfig(model=model, catalog=catalog,
                      search=from_args(SearchConfig, ns, max_beam_width=max(ns.max_beam_width, ns.beam_width)))
    if cfg.search.beam_width < check.top_n:
        raise UsageError(f"--top-n {check.top_n} is more than --beam-width {cfg.search.beam_width}")
    result, record = run_check(cfg, check, requests)
    if not check.json_only:
        print(table(result, record), file=sys.stderr)
    print(json.dumps(record))
    return 0 if record["passes"] else 1
