"""One LLM output path across cluster instances (``engine.types.Handover``): an attempt that continues a request
begun elsewhere produces exactly the events the uninterrupted request would have from there on — the same token
ids and the same text deltas, stop strings and held-back characters included — because the engine replays the
delivered tokens through its own decoder instead of a front end re-decoding the output. A ``pause`` ends an
attempt without releasing held-back text; the K/V a prefill computed goes out with its first token and, loaded
into another engine, replaces the prefill."""

from __future__ import annotations

import pytest
import torch

from grserve.engine.llm import TokenEvent, build_model_engine
from grserve.engine.sampling import SamplingParams
from grserve.engine.tokenizer import load_tokenizer
from grserve.engine.types import Handover
from grserve.scheduler.llm_factory import make_llm_scheduler

PROMPT = list(range(300, 340))


@pytest.fixture(scope="module")
def make_engine(tiny_model, tmp_path_factory):
    model = tiny_model(0)
    spec = model.spec
    tok = load_tokenizer("tiny", spec.vocab_size, spec.max_position_embeddings, tmp_path_factory.mktemp("tok"))

    def make(**kw):
        return build_model_engine(model, make_llm_scheduler("fcfs"), num_blocks=256, block_size=8,
                                  eos_token_id=None, detokenize=tok.decode, decoder_factory=tok.decode_stream, **kw)

    return make


def _run(eng, params: SamplingParams, handover: Handover | None = None) -> list[TokenEvent]:
    events: list[TokenEvent] = []
    eng.add_request(PROMPT, params, on_event=events.append, handover=handover)
    while eng.has_work():
        eng.step()
    return events


def _ids(events: list[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                                    SamplingParams(max_tokens=24, temperature=0.9, seed=5, presence_penalty=0.7,
                                                   ignore_eos=True)], ids=["greedy", "seeded-penalised"])
def test_a_resumed_attempt_continues_the_request_exactly(make_engine, params):
    whole = _run(make_engine(), params)
    assert len(_ids(whole)) == 24
    for k in (1, 9, 23):
        rest = _run(make_engine(), params, Handover(delivered=_ids(whole)[:k]))
        assert _ids(rest) == _ids(whole)[k:]
        assert [e.text for e in rest] == [e.text for e in whole[k:]]  # text deltas, not a re-decoded whole
        assert rest[-1].finish_reason == "length"


def test_a_stop_string_spanning_the_move_is_found_by_the_new_attempt(make_engine):
    sampled = SamplingParams(max_tokens=24, temperature=0.9, seed=5, ignore_eos=True)  # varied text, no repeats
    probe = _run(make_engine(), sampled)
    text = "".join(e.text for e in probe)
    shown = len("".join(e.text for e in probe[:10]))  # the text of the first 10 tokens
    stop = text[shown - 2:shown + 2]  # begins in the 10th token's text, ends in the 11th's
    assert text.count(stop) == 1
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=5, ignore_eos=True, stop=[stop])
    whole = _run(make_engine(), params)
    assert whole[-1].finish_reason == "stop" and len(whole) > 10
    rest = _run(make_engine(), params, Handover(delivered=_ids(whole)[:10]))
    assert [e.text for e in rest] == [e.text for e in whole[10:]] and rest[-1].finish_reason == "stop"
    assert stop not in "".join(e.text for e in whole + rest)


def test_a_pause_keeps_held_back_text_and_the_kv_replaces_the_prefill(make_engine):
    """PD's prefill attempt: one token, finish "pause" (its held-back text is not flushed as a finish would),
    the prompt's K/V on its event; the decode attempt loads that K/V and computes only the delivered token."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=["@@@@@@"])  # holds 5 characters
    whole = _run(make_engine(), params)
    first = _run(make_engine(), params, Handover(pause_after=1, export_kv=True))
    assert len(first) == 1 and first[0].finish_reason == "pause" and first[0].token_ids == whole[0].token_ids
    assert first[0].text == whole[0].text  # nothing flushed at the pause
    kv = first[0].prompt_kv
    spec = make_engine().executor.model.spec
    assert kv is not None and kv.shape == (spec.num_hidden_layers, 2, len(PROMPT), spec.kv_size)
    decode = make_engine()
    rest = _run(decode, params, Handover(delivered=first[0].token_ids, prompt_kv=kv))
    assert _ids(rest) == _ids(whole)[1:] and [e.text for e in rest] == [e.text for e in whole[1:]]
    assert decode.stats["prefix_hit_tokens"] == len(PROMPT)
    assert decode.stats["prefill_tokens"] == 1  # the first token's row: the prompt came with its K/V
    wrong = _run(make_engine(), params, Handover(delivered=first[0].token_ids, prompt_kv=torch.zeros_like(kv)))
    assert _ids(wrong) != _ids(whole)[1:]  # the loaded K/V is what the attempt attends to


def test_nothing_left_to_generate_is_refused(make_engine):
    with pytest.raises(ValueError, match="nothing left"):
        make_engine().add_request(PROMPT, SamplingParams(max_tokens=2), handover=Handover(delivered=[1, 2]))
