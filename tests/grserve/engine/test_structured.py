"""Structured output in the engine (``engine/structured.py``): the grammar mask is applied per row before the
choice, constrained and unconstrained requests share a batch without changing the unconstrained ones' tokens, a
constrained greedy row never takes the screened greedy head, a handover replays the delivered tokens through the
grammar, and special tokens are never part of constrained text."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from grserve.engine.async_llm import structured_backend
from grserve.engine.llm import build_model_engine
from grserve.engine.sampling import SampleRow, SamplingParams, sample
from grserve.engine.structured import GrammarError, StructuredSpec, check, mask_logits
from grserve.engine.tokenizer import load_tokenizer
from grserve.engine.types import Handover
from grserve.model import ModelSpec
from grserve.scheduler.llm_factory import make_llm_scheduler

jsonschema = pytest.importorskip("jsonschema")

SPEC = ModelSpec(family="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=1024)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["a", "b", "c"]}, "ok": {"type": "boolean"},
    "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4}},
    "required": ["name", "n", "kind", "ok", "xs"], "additionalProperties": False}
JSON = StructuredSpec("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from grserve.model.decoder import Decoder
    from grserve.model.loader import _random_init

    model = Decoder(SPEC).eval().requires_grad_(False)
    _random_init(model, 5)
    tok = load_tokenizer("preset", SPEC.vocab_size, SPEC.max_position_embeddings, tmp_path_factory.mktemp("tok"))
    backend = structured_backend(tok, SPEC.vocab_size)

    def make():
        return build_model_engine(model, make_llm_scheduler("fcfs"), num_blocks=1024, block_size=8,
                                  eos_token_id=tok.eos_token_id, detokenize=tok.decode,
                                  decoder_factory=tok.decode_stream, structured=backend)

    return make, tok


def _run(eng, prompts, params, handovers=None):
    eng.keep_finished = True
    ids = [eng.add_request(p, sp, handover=h) for p, sp, h in zip(prompts, params, handovers or [None] * len(prompts))]
    while eng.has_work():
        eng.step()
    done = {s.seq_id: s for s in eng.finished}
    return [done[i] for i in ids]


def test_mask_logits_sets_disallowed_to_minus_inf():
    V = 70  # three words, the last partly past the vocabulary
    x = torch.zeros(3, V, dtype=torch.float64)
    allowed = [{0, 31, 32, 69}, {5}, set(range(V))]
    masks = np.zeros((2, 3), dtype=np.int32)
    for r, row in enumerate(allowed[:2]):
        for t in row:
            masks[r, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    mask_logits(x, [0, 1], masks)
    for r in range(2):
        assert {int(t) for t in torch.isfinite(x[r]).nonzero().flatten()} == allowed[r]
    assert torch.isfinite(x[2]).all()
    rows = [SampleRow(SamplingParams(temperature=1.0), seed=s, position=9, allowed=masks[0]) for s in range(20)]
    assert set(sample(torch.randn(20, V), rows).token_ids) <= allowed[0]


def test_check_names_what_does_not_compile():
    for spec in (StructuredSpec("json_schema", '{"type": "objectx"}'), StructuredSpec("regex", "(ab"),
                 StructuredSpec("grammar", "root ::= foo"), StructuredSpec("choice", "[]")):
        with pytest.raises(GrammarError):
            check(spec)
    check(StructuredSpec("choice", json.dumps(["a \"q\"", "π\n"])))


def test_constrained_outputs_valid_greedy_and_sampled(setup):
    make, tok = setup
    eng = make()
    prompts = [tok.encode(f"prompt {i}") for i in range(12)]
    params = [SamplingParams(max_tokens=150, temperature=0.0 if i < 2 else 1.0, seed=i, structured=JSON)
              for i in range(12)]
    for s in _run(eng, prompts, params):
        assert s.finish_reason == "stop", s.text
        jsonschema.validate(json.loads(s.text), SCHEMA)
        assert s.output_ids[-1] == tok.eos_token_id


def test_batched_beside_unconstrained_requests_leaves_them_unchanged(setup):
    """The unconstrained requests (greedy: the screened greedy head when alone; sampled) get the same tokens with
    constrained requests in their batch as alone."""
    make, tok = setup
    prompts = [tok.encode(f"free {i}") for i in range(4)]
    free = [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 == 0 else 0.9, seed=100 + i, ignore_eos=True)
            for i in range(4)]
    alone = [s.output_ids for s in _run(make(), prompts, free)]
    greedy_alone = [s.output_ids for s in _run(make(), prompts[::2], free[::2])]  # the greedy head's batches
    assert greedy_alone == alone[::2]
    cons = [SamplingParams(max_tokens=150, temperature=t, seed=7, structured=sp)
            for t, sp in ((0.0, JSON), (1.0, JSON), (1.0, StructuredSpec("regex", "[a-z]{5,30}")))]
    mixed = _run(make(), prompts + [tok.encode("c")] * 3, free + cons)
    assert [s.output_ids for s in mixed[:4]] == alone
    jsonschema.validate(json.loads(mixed[4].text), SCHEMA)


def test_handover_replays_delivered_tokens_through_the_grammar(setup):
    make, tok = setup
    p = SamplingParams(max_tokens=150, temperature=1.0, seed=3, structured=JSON)
    whole = _run(make(), [tok.encode("x")], [p])[0].output_ids
    k = len(whole) // 2
    rest = _run(make(), [tok.encode("x")], [p], [Handover(delivered=whole[:k])])[0].output_ids
    assert rest == whole
    with pytest.raises(ValueError):  # delivered tokens the grammar refuses
        make().add_request(tok.encode("x"), p, handover=Handover(delivered=tok.encode("zz", add_special_tokens=False)))


def test_special_tokens_never_allowed_in_constrained_text(setup):
    make, tok = setup
    eng = make()
    m = eng.structured.matcher(StructuredSpec("regex", ".{0,40}"))
    from grserve.engine.structured import fill_bitmasks

    bits = np.unpackbits(fill_bitmasks([m], eng.structured.words).view(np.uint8), bitorder="little")
    assert bits[0] == 0 and bits[1] == 0  # <pad>, <bos>
    assert bits[tok.eos_token_id] == 1  # the stop token: the regex may end here
    assert bits[3 + ord("a")] == 1


def test_bad_spec_refused_at_add_request(setup):
    make, tok = setup
    with pytest.raises(GrammarError):
        make().add_request(tok.encode("x"), SamplingParams(structured=StructuredSpec("regex", "(ab")))


def _async_engine(setup, backend):
    from grserve.engine.async_llm import AsyncLLMEngine

    make, tok = setup
    core = make()
    core.structured = backend
    return AsyncLLMEngine(core, tokenizer=tok).start(), tok


def test_a_grammar_compiles_off_the_step_loop(setup, tmp_path):
    """A structured request whose grammar is still compiling holds up no other request: its compile runs on a
    thread of its own (here it waits until the unconstrained request has finished; compiled on the step loop, as
    it was, that request would never finish and this test would time out), then it runs as before. A request
    cancelled while its grammar compiles fails as cancelled; a grammar that does not compile fails its request."""
    import threading

    from grserve.engine.protocol import RequestCancelled
    from grserve.engine.types import LLMRequest

    _, tok = setup
    backend = structured_backend(tok, SPEC.vocab_size)
    release, compiling = threading.Event(), threading.Event()
    real = backend.compiled

    def slow(spec):
        if spec.text.startswith("[a-z]"):
            compiling.set()
            assert release.wait(60)
        return real(spec)

    backend.compiled = slow
    eng, tok = _async_engine(setup, backend)
    try:
        slow_spec = StructuredSpec("regex", "[a-z]{5,9}")
        held = eng.submit(LLMRequest(tok.encode("c"), SamplingParams(max_tokens=40, temperature=0.0,
                                                                     structured=slow_spec)))
        assert compiling.wait(30)
        dropped = eng.submit(LLMRequest(tok.encode("d"), SamplingParams(max_tokens=40, structured=slow_spec)))
        assert eng.queue_depth >= 2 and eng.cancel(dropped.request_id)
        free = eng.submit(LLMRequest(tok.encode("free"), SamplingParams(max_tokens=8, temperature=0.0,
                                                                        ignore_eos=True)))
        assert len(free.future.result(timeout=60).output_ids) == 8
        assert not held.future.done()
        release.set()
        text = held.future.result(timeout=60).text
        assert 5 <= len(text) <= 9 and text.isalpha(), text
        with pytest.raises(RequestCancelled):
            dropped.future.result(timeout=60)
        bad = eng.submit(LLMRequest(tok.encode("x"), SamplingParams(structured=StructuredSpec("regex", "(ab"))))
        with pytest.raises(GrammarError):
            bad.future.result(timeout=60)
        assert eng.queue_depth == 0
    finally:
        release.set()
        eng.stop()
