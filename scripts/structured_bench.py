"""What structured output's grammar mask costs a decode step (docs/llm.md, "Structured output"):

    PYTHONPATH=src .venv/bin/python scripts/structured_bench.py [PRESET] [BATCH] [STEPS] [ROUNDS]

(default tiny 8 40 3). Runs BATCH sampled requests (temperature 1) that decode STEPS tokens under a JSON schema
that cannot end sooner (an array of 40 objects), and the same BATCH requests unconstrained, in interleaved rounds
on one engine, one torch thread. For the constrained runs it times, per decode step, the grammar's own work: every
matcher's bitmask (``structured.fill_bitmasks``), the mask on the logits (``structured.mask_logits``, called by the
sampler) and the matchers' ``accept_token``; and the whole step (``LLMEngine.step``). Prints the medians over the
rounds: mask ms / step ms, the ratio, and the unconstrained step for comparison (which also takes the screened
greedy head's path never, as both sample).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

import grserve.engine.llm as llm_mod
import grserve.engine.sampling as sampling_mod
from grserve.engine.async_llm import structured_backend
from grserve.engine.llm import build_model_engine
from grserve.engine.sampling import SamplingParams
from grserve.engine.structured import StructuredSpec
from grserve.engine.tokenizer import load_tokenizer
from grserve.model import load_model
from grserve.scheduler.llm_factory import make_llm_scheduler

SCHEMA = {"type": "array", "minItems": 40, "maxItems": 40, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "tag", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999}, "tag": {"type": "string", "maxLength": 12},
                   "ok": {"type": "boolean"}}}}

MASK_S = [0.0, 0.0, 0.0]  # this step's fill, mask, accept seconds


def _timed(fn, slot):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            MASK_S[slot] += time.perf_counter() - t
    return wrapper


class TimedMatcher:
    def __init__(self, m):
        self.m = m

    def fill_next_token_bitmask(self, *a):
        return self.m.fill_next_token_bitmask(*a)  # timed as part of fill_bitmasks

    def accept_token(self, tok):
        t = time.perf_counter()
        try:
            return self.m.accept_token(tok)
        finally:
            MASK_S[2] += time.perf_counter() - t

    def is_terminated(self):
        return self.m.is_terminated()


def run(eng, prompts, params, steps):
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    for i in ids:
        s = eng.seqs[i]
        if s.grammar is not None:
            s.grammar = TimedMatcher(s.grammar)
    eng.step()  # the prefill of all of them
    step_s, mask_s = [], []
    for _ in range(steps - 1):
        MASK_S[:] = [0.0, 0.0, 0.0]
        t = time.perf_counter()
        eng.step()
        step_s.append(time.perf_counter() - t)
        mask_s.append(list(MASK_S))
        assert len(eng.running) == len(ids), "a request ended early"
    while eng.has_work():
        eng.step()
    return statistics.median(step_s) * 1e3, [statistics.median(m[j] for m in mask_s) * 1e3 for j in range(3)]


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    torch.set_num_threads(1)
    model = load_model(preset)
    spec = model.spec
    tok = load_tokenizer(preset, spec.vocab_size, spec.max_position_embeddings)
    eng = build_model_engine(model, make_llm_scheduler("fcfs"), num_blocks=4096, block_size=16,
                             eos_token_id=tok.eos_token_id, detokenize=tok.decode, decoder_factory=tok.decode_stream,
                             structured=structured_backend(tok, spec.vocab_size))
    llm_mod.fill_bitmasks = _timed(llm_mod.fill_bitmasks, 0)
    sampling_mod.mask_logits = _timed(sampling_mod.mask_logits, 1)
    js = StructuredSpec("json_schema", json.dumps(SCHEMA))
    t = time.perf_counter()
    eng.structured.compiled(js)
    print(f"compile (tokenizer info + schema, first time): {time.perf_counter() - t:.3f} s")
    prompts = [tok.encode(f"Write record {i} as JSON:") for i in range(batch)]
    res = {"constrained": [], "free": []}
    for r in range(rounds):
        for kind in ("constrained", "free"):
            params = [SamplingParams(max_tokens=steps + 1, temperature=1.0, seed=1000 * r + i, ignore_eos=True,
                                     structured=js if kind == "constrained" else None) for i in range(batch)]
            res[kind].append(run(eng, prompts, params, steps))
    step_c = statistics.median(s for s, _ in res["constrained"])
    parts = [statistics.median(m[j] for _, m in res["constrained"]) for j in range(3)]
    mask_c = sum(parts)
    step_f = statistics.median(s for s, _ in res["free"])
    print(f"{preset}, batch {batch}, {steps} decode steps x {rounds} rounds, 1 torch thread, vocab {spec.vocab_size}")
    print(f"constrained step {step_c:.2f} ms, of which grammar (fill + mask + accept) {mask_c:.3f} ms "
          f"= {100 * mask_c / step_c:.1f} % (fill {parts[0]:.3f}, mask {parts[1]:.3f}, accept {parts[2]:.3f})")
    print(f"unconstrained step {step_f:.2f} ms (difference {step_c - step_f:+.2f} ms)")


if __name__ == "__main__":
    main()
