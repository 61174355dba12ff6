"""oneDNN-packed projections (``model/packed_linear.py``) against their reference, ``F.linear``, and HF.

Tolerances: one projection ≤ 1e-5 relative to its output's scale (fp32 summation order only); the decoder's
logits with and without packing ≤ 1e-4 (as every model-vs-HF test); greedy tokens through the engine (which packs by
default) identical to HF ``generate`` and to the engine without packing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grserve.attention.context import SequenceKVContext
from grserve.engine.llm import build_model_engine
from grserve.engine.sampling import SamplingParams
from grserve.model.packed_linear import PackedLinears, can_pack, linear, maybe_pack, projections
from grserve.scheduler.fcfs import FCFSScheduler



def _needs_onednn(model) -> None:
    if not can_pack(model):
        pytest.skip("this torch build has no oneDNN matmul")


@pytest.mark.parametrize("rows", [1, 3, 32, 77])
@pytest.mark.parametrize("bias", [False, True])
def test_one_projection_equals_f_linear(tiny_model, rows, bias):
    model = tiny_model(0)
    _needs_onednn(model)
    lin = torch.nn.Linear(256, 384, bias=bias)
    torch.manual_seed(rows)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        if bias:
            lin.bias.normal_(0, 0.05)
    packed = PackedLinears(model)
    packed.weights[lin] = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 32)
    x = torch.randn(rows, 256)
    for inp in (x, torch.randn(256, rows).T):  # contiguous and transposed input
        with torch.inference_mode():
            got, ref = linear(inp, lin, packed), F.linear(inp, lin.weight, lin.bias)
        assert got.shape == ref.shape and got.dtype == ref.dtype
        assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_packs_every_projection_and_leaves_the_model_alone(tiny_model):
    model = tiny_model(0)
    _needs_onednn(model)
    before = {n: p.clone() for n, p in model.named_parameters()}
    packed = PackedLinears(model)
    assert len(packed) == 7 * model.spec.num_hidden_layers == len(projections(model))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert maybe_pack(model, enabled=False) is None


def test_decoder_logits_packed_equal_reference_and_hf(hf_qwen3):
    hf, ours = hf_qwen3(kv_heads=2, seed=3, perturb_norms=True)
    _needs_onednn(ours)
    packed = PackedLinears(ours)
    ids = torch.randint(3, 300, (23,), generator=torch.Generator().manual_seed(5))
    pos, L = torch.arange(23), ours.spec.num_hidden_layers
    with torch.inference_mode():
        ref = ours.logits(ours(ids, pos, SequenceKVContext(L)))
        got = ours.logits(ours(ids, pos, SequenceKVContext(L), packed=packed))
        want = hf(input_ids=ids[None]).logits[0]
    assert float((got - ref).abs().max()) <= 1e-4
    assert float((got - want).abs().max()) <= 1e-4


def test_engine_greedy_tokens_equal_hf_with_and_without_packing(hf_qwen3):
    hf, ours = hf_qwen3(kv_heads=2, seed=3, perturb_norms=True)
    _needs_onednn(ours)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in torch.randint(4, 20, (5,), generator=g)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for pack in (True, False):
        eng = build_model_engine(ours, FCFSScheduler(), num_blocks=64, block_size=4, packed_linears=pack)
        assert (eng.executor.packed is not None) == pack
        outs[pack] = eng.generate(prompts, sp)
    assert outs[True] == outs[False]
    for p, got in zip(prompts, outs[True]):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist()
        assert got == ref


def test_shared_pack_is_one_copy_per_model_until_a_weight_changes(tiny_model):
    from grserve.model import load_model
    from grserve.model.packed_linear import shared_pack

    model = load_model("tiny", seed=11)  # its own model: the weight is written below
    if not can_pack(model):
        assert shared_pack(model) is None
        return
    first = shared_pack(model)
    assert shared_pack(model) is first and shared_pack(model, enabled=False) is None
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2.0)
    again = shared_pack(model)
    assert again is not first  # packed again from the new weights
    x = torch.randn(5, model.spec.hidden_size)
    up = model.model.layers[0].mlp.up_proj
    assert torch.allclose(linear(x, up, again), F.linear(x, up.weight), rtol=1e-5, atol=1e-5)
