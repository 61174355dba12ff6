"""Is the LLM engine batch-invariant? One request alone vs inside batches of other requests (issue 42).

    PYTHONPATH=src .venv/bin/python scripts/llm_batch_invariance.py                      # bf16, default engine
    PYTHONPATH=src .venv/bin/python scripts/llm_batch_invariance.py --batch-invariant 1  # the option on
    PYTHONPATH=src .venv/bin/python scripts/llm_batch_invariance.py --ops                # + the op probes

The engine ``grserve serve llm`` runs (``build_model_engine`` over the preset's seeded weights, a chunked-prefill
scheduler) is driven directly: the target request (greedy, ``--max-tokens``, ``ignore_eos``) runs alone, then with
1, 3, 7, 31 other requests (other prompts and lengths; half of them join at later steps). Every op of the decoder
(each projection, q/k norms, attention, the layer norms, the final norm, the logits) is recorded for the target's
rows, keyed by (position, layer, op), and each batched run is compared with the alone run: the report names the
first op (in the order the alone run computed them) whose output differs bitwise, and the first differing token.

``--ops`` also probes the candidate ops in isolation: a GEMM's row 0 at row counts M (oneDNN-packed and F.linear,
the LM head), RMSNorm at N rows, and SDPA over the same keys padded to a longer, masked key length.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F


def prompt(rng: np.random.Generator, lo: int, hi: int) -> list[int]:
    return rng.integers(5, 30000, int(rng.integers(lo, hi))).tolist()


class Recorder:
    """Records the target request's rows of every decoder op, by (position, layer, op)."""

    def __init__(self) -> None:
        self.rows: dict[tuple, torch.Tensor] = {}
        self.order: list[tuple] = []
        self.cur: tuple[list[int], list[int]] | None = None  # (packed rows of the target, their positions)
        self.layer = -1

    def put(self, op: str, t: torch.Tensor, last: bool = False) -> None:
        if self.cur is None:
            return
        rows, pos = self.cur
        if last:  # a tensor of the sampled rows only: the target's is the last of its rows, if it samples
            rows, pos = ([self.sample_row], [pos[-1]]) if self.sample_row is not None else ([], [])
        n = t.shape[0]
        for r, p in zip(rows, pos):
            if r < n:
                key = (p, self.layer, op)
                if key not in self.rows:
                    self.order.append(key)
                self.rows[key] = t[r].detach().clone()


def instrument(engine, target_id_of, rec: Recorder):
    """Wrap the executor and the decoder's ops so that ``rec`` sees the target's rows."""
    from grserve.model import decoder as dec

    ex = engine.executor
    execute = ex.execute

    def traced_execute(items, pool):
        tid = target_id_of()
        rec.cur, rec.sample_row = None, None
        off, samp = 0, 0
        for it in items:
            if it.seq.seq_id == tid:
                rec.cur = (list(range(off, off + it.num_new)), list(range(it.start, it.start + it.num_new)))
                rec.sample_row = samp if it.sample else None
            off += it.num_new
            samp += int(it.sample)
        rec.layer = -1
        return execute(items, pool)

    ex.execute = traced_execute

    def patch(obj, name, value):
        _UNDO.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)
    model = ex.model
    names = {}
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        for nm, lin in (("q_proj", a.q_proj), ("k_proj", a.k_proj), ("v_proj", a.v_proj), ("o_proj", a.o_proj),
                        ("gate_proj", m.gate_proj), ("up_proj", m.up_proj), ("down_proj", m.down_proj)):
            names[lin] = (i, nm)
        names[layer.input_layernorm] = (i, "input_layernorm")
        names[layer.post_attention_layernorm] = (i, "post_attention_layernorm")
        if a.q_norm is not None:
            names[a.q_norm] = (i, "q_norm")
            names[a.k_norm] = (i, "k_norm")
    names[model.model.norm] = (len(model.model.layers), "final_norm")
    orig_gl = dec.grouped_linear

    def gl(x, lin, packed=None, groups=None):
        y = orig_gl(x, lin, packed, groups)
        rec.layer, nm = names[lin]
        if nm == "q_proj" and y.shape[0] != x.shape[0]:
            return y
        rec.put(nm, y)
        return y

    patch(dec, "grouped_linear", gl)
    orig_norm = dec.RMSNorm.forward

    def norm(self, x):
        y = orig_norm(self, x)
        if self in names:
            rec.layer, nm = names[self]
            if nm in ("q_norm", "k_norm"):
                return y  # [N, heads, d]: recorded as is
            rec.put(nm, y)
        return y

    patch(dec.RMSNorm, "forward", norm)
    from grserve.attention import hybrid

    orig_attend = hybrid.HybridPagedContext.attend

    def attend(self, layer, q, k, v):
        o = orig_attend(self, layer, q, k, v)
        rec.layer = layer
        rec.put("attention", o)
        return o

    patch(hybrid.HybridPagedContext, "attend", attend)
    orig_logits = type(model).logits

    def logits(self, hidden, *a, **kw):
        y = orig_logits(self, hidden, *a, **kw)
        rec.layer = len(self.model.layers) + 1
        rec.put("logits", y, last=True)
        return y

    patch(type(model), "logits", logits)


def run(model, cfg, target: list[int], others: list[tuple[int, list[int], int]], max_tokens: int,
        record: bool = True):
    """The target's output ids (and its Recorder) with ``others`` = [(join step, prompt, max tokens)]."""
    from grserve.engine.llm import build_model_engine
    from grserve.engine.sampling import SamplingParams
    from grserve.scheduler.llm_factory import make_llm_scheduler

    pol = make_llm_scheduler(cfg.scheduler, token_budget=cfg.token_budget,
                             max_num_batched_tokens=cfg.token_budget, max_num_seqs=256)
    extra = {"batch_invariant": True} if cfg.batch_invariant else {}
    eng = build_model_engine(model, pol, num_blocks=2048, block_size=16, **extra)
    rec = Recorder()
    tid = [None]
    if record:
        instrument(eng, lambda: tid[0], rec)
    eng.keep_finished = True
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    joins = defaultdict(list)
    for step, p, n in others:
        joins[step].append((p, n))
    first = [(p, n) for p, n in joins.pop(0, [])]
    half = len(first) // 2
    for p, n in first[:half]:
        eng.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    tid[0] = eng.add_request(target, greedy)
    for p, n in first[half:]:
        eng.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    step = 0
    try:
        while eng.has_work() or joins:
            step += 1
            for p, n in joins.pop(step, []):
                eng.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            if eng.has_work():
                eng.step()
    finally:
        restore()
    out = {s.seq_id: s for s in eng.finished}[tid[0]].output_ids
    return out, rec, eng


_UNDO: list = []


def restore():
    """Undo ``instrument``'s patches (the next run patches afresh)."""
    while _UNDO:
        obj, name, value = _UNDO.pop()
        setattr(obj, name, value)


def first_diff(alone: Recorder, other: Recorder):
    for key in alone.order:
        b = other.rows.get(key)
        if b is None:
            continue
        a = alone.rows[key]
        if a.shape != b.shape or not torch.equal(a, b):
            return key, float((a.float() - b.float()).abs().max()) if a.shape == b.shape else None
    return None, None


def probe_ops(dtype: torch.dtype) -> None:
    from grserve.model import load_model
    from grserve.model.packed_linear import PackedLinears, can_pack

    m = load_model("tiny", dtype=dtype, seed=1)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        pk = PackedLinears(m) if can_pack(m) else None
        ms = (1, 2, 3, 7, 8, 16, 32, 64, 256, 1024)
        for nm, lin in (("gate_proj", m.model.layers[0].mlp.gate_proj), ("down_proj", m.model.layers[0].mlp.down_proj)):
            x = torch.randn(max(ms), lin.in_features, generator=g).to(dtype)
            for label, fn in (("oneDNN-packed", (lambda z: pk.linear(z, lin)) if pk else None),
                              ("F.linear", lambda z: F.linear(z, lin.weight))):
                if fn is None:
                    continue
                ref = fn(x[:1])
                bad = [M for M in ms if not torch.equal(fn(x[:M])[:1], ref)]
                print(f"  {dtype} {nm} {label}: row 0 differs at M = {bad or 'none'}")
        x = torch.randn(64, m.spec.hidden_size, generator=g).to(dtype)
        ref = F.linear(x[:1], m.lm_head.weight)
        bad = [M for M in (2, 3, 8, 32, 64) if not torch.equal(F.linear(x[:M], m.lm_head.weight)[:1], ref)]
        print(f"  {dtype} LM head F.linear: row 0 differs at M = {bad or 'none'}")
        n = m.model.norm
        bad = [M for M in (2, 7, 64) if not torch.equal(n(x[:M])[:1], n(x[:1]))]
        print(f"  {dtype} RMSNorm: row 0 differs at N = {bad or 'none'}")
        hkv, gq, d = m.spec.num_key_value_heads, m.spec.num_attention_heads // m.spec.num_key_value_heads, m.spec.head_dim
        for L0 in (100, 130, 257, 300, 600, 1100):
            q = torch.randn(3, hkv, gq, d, generator=g).to(dtype)
            k = torch.randn(3, hkv, 2048, d, generator=g).to(dtype)
            v = torch.randn(3, hkv, 2048, d, generator=g).to(dtype)
            ref = F.scaled_dot_product_attention(q, k[:, :, :L0], v[:, :, :L0])
            bad = []
            for T in sorted({L0 + 1, L0 + 7, L0 + 70, 512, 1024, 2048}):
                if T <= L0:
                    continue
                mask = (torch.arange(T) < L0)[None, None, None, :]
                if not torch.equal(F.scaled_dot_product_attention(q, k[:, :, :T], v[:, :, :T], attn_mask=mask), ref):
                    bad.append(T)
            print(f"  {dtype} SDPA decode over {L0} keys, padded (masked) to T: differs at T = {bad or 'none'}")


def prefill_cost(model, lengths: list[int], repeats: int = 3) -> int:
    """ms of this thread's CPU time for one prompt's prefill alone (one chunk), best of ``repeats``, per setting."""
    import time

    from grserve.engine.llm import build_model_engine
    from grserve.engine.sampling import SamplingParams
    from grserve.scheduler.llm_factory import make_llm_scheduler

    rng = np.random.default_rng(0)
    for n in lengths:
        best = {}
        for _ in range(repeats):
            for inv in (False, True):
                pol = make_llm_scheduler("chunked", token_budget=max(lengths))
                eng = build_model_engine(model, pol, num_blocks=4 * max(lengths) // 16 + 8, block_size=16,
                                         batch_invariant=inv)
                eng.add_request(prompt(rng, n, n + 1), SamplingParams(max_tokens=1, temperature=0.0))
                t = time.thread_time()
                eng.step()
                best[inv] = min(best.get(inv, float("inf")), time.thread_time() - t)
        print(f"prefill of {n} tokens alone: {best[False] * 1e3:.1f} ms (default), {best[True] * 1e3:.1f} ms "
              f"(batch_invariant), x{best[True] / best[False]:.2f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=220)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 32])
    ap.add_argument("--scheduler", default="chunked")
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--batch-invariant", type=int, choices=(0, 1), default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ops", action="store_true")
    ap.add_argument("--no-record", action="store_true", help="compare tokens only (faster)")
    ap.add_argument("--prefill-cost", type=int, nargs="*", default=None, metavar="TOKENS",
                    help="instead: time one prompt's prefill alone (this thread's CPU time), option off vs on")
    cfg = ap.parse_args()
    cfg.batch_invariant = bool(cfg.batch_invariant)
    torch.set_num_threads(cfg.threads)
    from grserve.model import load_model

    dtype = getattr(torch, cfg.dtype)
    if cfg.ops:
        print("op probes (row 0 of a batch vs alone):")
        probe_ops(dtype)
    model = load_model("tiny", dtype=dtype, seed=3)
    if cfg.prefill_cost is not None:
        return prefill_cost(model, cfg.prefill_cost or [512, 2048])
    rng = np.random.default_rng(42)
    target = prompt(rng, 300, 301)
    alone, rec_alone, eng = run(model, cfg, target, [], cfg.max_tokens, not cfg.no_record)
    print(f"{cfg.dtype}, batch_invariant={cfg.batch_invariant}, scheduler {cfg.scheduler}, token budget "
          f"{cfg.token_budget}: target prompt {len(target)} tokens, {len(alone)} greedy tokens alone "
          f"({eng.executor.describe()})")
    bad = 0
    for size in cfg.sizes:
        r = np.random.default_rng(size)
        others = [(0 if j % 2 == 0 else int(r.integers(1, 60)), prompt(r, 20, 400), int(r.integers(20, 260)))
                  for j in range(size - 1)]
        out, rec, _ = run(model, cfg, target, others, cfg.max_tokens, not cfg.no_record)
        tok = next((i for i, (a, b) in enumerate(zip(alone, out)) if a != b), None)
        key, delta = first_diff(rec_alone, rec) if not cfg.no_record else (None, None)
        bad += tok is not None or key is not None
        where = "" if key is None else (f"; first differing op: position {key[0]}, layer {key[1]}, {key[2]} "
                                        f"(max |diff| {delta})")
        print(f"  with {size - 1:2d} others: tokens {'identical' if tok is None else f'differ from token {tok}'}"
              f"{where}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
