"""The bf16-screened exact greedy head (engine/greedy_head.py) = argmax of the fp32 logits, including near-ties
far below bf16 resolution, exact ties (lowest index), wide candidate bands (the row-scan fallback) and extreme
scales; and the engine takes this path only when every sampled row is greedy."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from grserve.engine.greedy_head import ALL_ROWS, ScreenedGreedyHead
from grserve.model import cpu_support as cs


def _ref(h, w):
    return F.linear(h, w).argmax(dim=1)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
@pytest.mark.parametrize("packed", [True, False])
def test_matches_fp32_argmax_random(seed, scale, packed):
    """Both screens: the oneDNN-packed bf16 GEMM (default on a CPU with oneDNN) and plain ``F.linear``."""
    g = torch.Generator().manual_seed(seed)
    v, d = 3000, 64
    w = torch.randn(v, d, generator=g) * 0.05 * scale
    h = torch.randn(17, d, generator=g) * scale
    head = ScreenedGreedyHead(w, screen_max_rows=ALL_ROWS, int8=False)
    if not packed:
        head.weight_lo_packed = None
    elif head.weight_lo_packed is None:
        pytest.skip("this torch build has no oneDNN matmul")
    assert torch.equal(head.argmax(h), _ref(h, w))


def test_near_ties_below_bf16_resolution():
    """Pairs of rows whose logits differ by ~1e-6 relative (bf16 cannot tell them apart): the exact pass must."""
    g = torch.Generator().manual_seed(1)
    v, d = 500, 32
    w = torch.randn(v, d, generator=g)
    h = torch.randn(8, d, generator=g)
    for r in range(8):  # for row r, make two rows the top, differing in the 6th significant digit
        best = int(_ref(h[r:r + 1], w))
        j = (best + 1 + r) % v
        w[j] = w[best] * (1 + (1e-6 if r % 2 else -1e-6))
    head = ScreenedGreedyHead(w, screen_max_rows=ALL_ROWS, int8=False)
    got, want = head.argmax(h), _ref(h, w)
    assert torch.equal(got, want)
    assert head.stats["candidates"] > head.stats["rows"]  # the near-ties did go to the exact pass


def test_exact_ties_take_the_lowest_index_and_wide_bands_scan_the_row():
    d = 16
    w = torch.zeros(40, d)
    w[:, 0] = 1.0  # 40 identical rows: every logit equal, a band far wider than the top k
    h = torch.randn(3, d)
    h[:, 0] = 2.0
    head = ScreenedGreedyHead(w, screen_max_rows=ALL_ROWS, int8=False)
    assert head.argmax(h).tolist() == [0, 0, 0] == _ref(h, w).tolist()
    assert head.stats["candidates"] == 3 * 40


def test_rejects_non_fp32_weights():
    with pytest.raises(ValueError):
        ScreenedGreedyHead(torch.zeros(4, 4, dtype=torch.bfloat16))


def test_engine_uses_it_only_for_all_greedy_passes(random_decoder):
    if not cs.cpu_support().fast_paths:
        pytest.skip("GRSERVE_CPU_ISA=reference: the engine runs without the head (tested below)")
    from grserve.engine.llm import build_model_engine
    from grserve.engine.sampling import SamplingParams
    from grserve.model import ModelSpec
    from grserve.scheduler.fcfs import FCFSScheduler

    spec = ModelSpec(family="qwen3", vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                     tie_word_embeddings=True, attention_bias=False, qk_norm=True, max_position_embeddings=256)
    model = random_decoder(spec, seed=3, std=0.3)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    runs = {}
    for screened in (True, False):
        eng = build_model_engine(model, FCFSScheduler(), num_blocks=32, block_size=4)
        if not screened:
            eng.executor.greedy_head = None
        runs[screened] = (eng.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)),
                          eng.executor.greedy_head)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].stats["rows"] == 2 * 6
    # a sampled (temperature > 0) request in the pass: full logits, the head is not called
    eng = build_model_engine(model, FCFSScheduler(), num_blocks=32, block_size=4)
    eng.generate(prompts, [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                           SamplingParams(max_tokens=3, temperature=0.8, seed=1, ignore_eos=True)])
    assert eng.executor.greedy_head.stats["rows"] == 0


def test_screen_order_flips_are_caught_by_the_bound():
    """Built so that bf16 rounding reverses the order of the top two: exact A = 1 + 0.51ε > B = 1 + 0.505ε, but
    A's weight rounds down (→ 1.0) and B's sum rounds up (→ 1 + ε), ε = 2⁻⁷ the bf16 spacing at 1. Only the
    error bound keeps A among the candidates (with a zero bound the screen alone would answer B)."""
    eps = 2.0 ** -7  # (one row: the screen runs on every CPU)
    w = torch.zeros(50, 2)
    w[:, 0] = -1.0  # everything else far below
    w[7] = torch.tensor([1 + 0.49 * eps, 0.02 * eps])  # A
    w[3] = torch.tensor([1.0, 0.505 * eps])  # B
    h = torch.tensor([[1.0, 1.0]])
    lo = F.linear(h.to(torch.bfloat16), w.to(torch.bfloat16)).float()
    assert int(lo.argmax()) == 3  # the screen alone is wrong
    head = ScreenedGreedyHead(w, int8=False)  # the bf16 screen's bound (the int8 one: test_int8_screen.py)
    assert int(head.argmax(h)) == 7 == int(_ref(h, w))


@pytest.mark.parametrize("packed", [True, False])
def test_exact_path_matches_fp32_argmax(packed):
    """Passes over ``screen_max_rows`` skip the screen: the fp32 argmax on a oneDNN-packed fp32 copy (CPUs
    without fast bf16) or ``F.linear``; ties to the lowest index as ``torch.argmax``."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(3000, 64, generator=g) * 0.05
    h = torch.randn(33, 64, generator=g)
    head = ScreenedGreedyHead(w, screen_max_rows=0, int8=False)
    if packed and head.weight_packed is None:
        if not cs.cpu_support().onednn:
            pytest.skip("no oneDNN fp32 matmul here")
        head.weight_packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
    if not packed:
        head.weight_packed = None
    assert torch.equal(head.argmax(h), _ref(h, w))
    assert head.stats["exact_rows"] == 33 and head.stats["rows"] == 0
    w2 = torch.zeros(40, 8)
    w2[:, 0] = 1.0
    assert ScreenedGreedyHead(w2, screen_max_rows=0, int8=False).argmax(torch.ones(3, 8)).tolist() == [0, 0, 0]


def test_without_fast_bf16_small_passes_screen_and_large_ones_go_exact(forced_cpu_isa):
    s = forced_cpu_isa("avx2")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2000, 48, generator=g) * 0.05
    head = ScreenedGreedyHead(w, int8=False)  # the int8 screen: test_int8_screen.py
    assert head.weight_lo_packed is None  # no bf16 reorder: it would raise on such a CPU
    assert (head.weight_packed is not None) == s.onednn and head.screen_max_rows == 2
    assert "no fast bf16" in head.describe()
    for rows in (1, 2, 3, 32):
        h = torch.randn(rows, 48, generator=g)
        assert torch.equal(head.argmax(h), _ref(h, w))
    assert head.stats["rows"] == 1 + 2 and head.stats["exact_rows"] == 3 + 32


def test_reference_level_runs_full_logits_and_gives_the_same_tokens(forced_cpu_isa, random_decoder):
    from grserve.engine.llm import build_model_engine
    from grserve.engine.sampling import SamplingParams
    from grserve.model import ModelSpec
    from grserve.scheduler.fcfs import FCFSScheduler

    spec = ModelSpec(family="qwen3", vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                     tie_word_embeddings=True, attention_bias=False, qk_norm=True, max_position_embeddings=256)
    model = random_decoder(spec, seed=3, std=0.3)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    fast = build_model_engine(model, FCFSScheduler(), num_blocks=32, block_size=4)
    want = fast.generate(prompts, sp)
    forced_cpu_isa("reference")
    ref = build_model_engine(model, FCFSScheduler(), num_blocks=32, block_size=4)
    ex = ref.executor
    assert ex.greedy_head is None and ex.staging is None and ex.packed is None
    assert "full logits" in ex.describe() and "reference" in ex.describe()
    assert ref.generate(prompts, sp) == want


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("vocab", [40, 128, 1000, 32000])
def test_chunk_band_equals_topk_band_and_fp32_argmax(seed, vocab):
    """The candidate band from 128-token chunk maxima (the default) and from the screen's top k (the reference)
    give the fp32 argmax, on random rows and on rows whose top tokens tie or nearly tie within one chunk and
    across chunks (exact ties: the lowest id, as ``torch.argmax``), over vocabularies that are and are not
    multiples of the chunk."""
    g = torch.Generator().manual_seed(seed)
    d = 32
    w = torch.randn(vocab, d, generator=g) * 0.1
    h = torch.randn(12, d, generator=g)
    best = _ref(h, w)
    for r in range(0, 12, 2):  # copy each even row's winner elsewhere: an exact tie, then near-ties
        j = int((best[r] + 1 + 97 * r) % vocab)
        if j != int(best[r]):
            w[j] = w[best[r]] * (1.0 if r % 4 == 0 else 1 + 1e-6)
    want = _ref(h, w)
    heads = {band: ScreenedGreedyHead(w, screen_max_rows=ALL_ROWS, band=band, int8=False) for band in ("chunks", "topk")}
    for head in heads.values():
        head.weight_lo_packed = None if seed % 2 else head.weight_lo_packed  # both screens
        assert torch.equal(head.argmax(h), want)
    assert heads["chunks"].stats["rows"] == heads["topk"].stats["rows"] == 12


@pytest.mark.parametrize("nan_row", [0, 3, 5])
def test_a_row_without_candidates_beside_rows_with_several(nan_row):
    """A NaN row has no candidates (its band's floor is NaN): the chunk band answers it with its screen row's
    ``argmax`` (all NaN: id 0, the sampler's answer for NaN logits), whatever the other rows of the pass need (one
    candidate, several, exact ties); the other rows are the fp32 argmax."""
    g = torch.Generator().manual_seed(nan_row)
    d, vocab = 16, 1000
    w = torch.randn(vocab, d, generator=g) * 0.1
    h = torch.randn(6, d, generator=g)
    best = _ref(h, w)
    w[(int(best[1]) + 300) % vocab] = w[best[1]]  # row 1: an exact tie in another chunk (several candidates)
    want = _ref(h, w)
    h[nan_row, 2] = float("nan")
    head = ScreenedGreedyHead(w, screen_max_rows=ALL_ROWS, int8=False)
    got = head.argmax(h)
    keep = [r for r in range(6) if r != nan_row]
    assert torch.equal(got[keep], want[keep]) and int(got[nan_row]) == 0
    assert head.stats["candidates"] > 5  # row 1 had two


@pytest.mark.parametrize("band", ["chunks", "topk"])
def test_a_nan_row_does_not_move_another_rows_token(band):
    """A NaN row (no candidates) beside a row with two (an exact tie) and a row with one: as many candidates as
    rows, which once passed for "one candidate per row" and handed the tied row's second candidate to the next
    row. Each finite row keeps its own answer (the tie's lowest id), whatever the NaN row gets."""
    w = torch.randn(1000, 16, generator=torch.Generator().manual_seed(0)) * 0.001
    w[5, 0] = w[7, 0] = 1.0
    w[9, 1] = 1.0
    h = torch.zeros(3, 16)
    h[0, 2] = float("nan")
    h[1, 0] = 1.0
    h[2, 1] = 1.0
    head = ScreenedGreedyHead(w, screen_max_rows=ALL_ROWS, band=band, int8=False)
    got = head.argmax(h)
    assert got[1:].tolist() == [5, 9]
    if band == "chunks":
        assert int(got[0]) == 0  # its screen row's argmax: all NaN


def test_chunk_band_ties_across_chunks_take_the_lowest_id():
    d = 8
    w = torch.zeros(1000, d)
    w[:, 1] = -1.0
    for j in (900, 130, 517):  # identical winners in three chunks
        w[j] = torch.tensor([1.0] + [0.0] * (d - 1))
    h = torch.zeros(3, d)
    h[:, 0] = 1.0
    head = ScreenedGreedyHead(w, screen_max_rows=ALL_ROWS, int8=False)
    assert head.argmax(h).tolist() == [130, 130, 130] == _ref(h, w).tolist()
    assert head.stats["candidates"] == 3 * 3  # each row's band: the three ties, recomputed exactly


def test_band_name_is_checked():
    with pytest.raises(ValueError):
        ScreenedGreedyHead(torch.zeros(4, 4), band="sort")


def _sampler_greedy(logits):
    """The sampler's greedy choice over the same logits (float64, NaN as -inf, the lowest id on ties)."""
    from grserve.engine.sampling import SampleRow, SamplingParams, sample

    rows = [SampleRow(SamplingParams(temperature=0.0), seed=0, position=1) for _ in range(logits.shape[0])]
    return sample(logits, rows, eos_token_id=None).token_ids


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_model_dtype_head_picks_the_samplers_token(packed, rows):
    """A bf16 model's greedy pick (one ``max`` per row of the bf16 logits) is the sampler's float64 argmax over
    the same logits, ties included (bf16 logits tie often: 8 bits of mantissa); packed and F.linear logits."""
    from grserve.engine.greedy_head import ModelDtypeHead

    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(3000, 64, generator=g) * 0.05).to(torch.bfloat16)
    w[1500:] = w[:1500]  # every logit appears twice: exact ties, the lower id must win
    head = ModelDtypeHead(w)
    if packed and head.packed is None:
        pytest.skip("no fast bf16 oneDNN matmul on this CPU")
    if not packed:
        head.packed = None
    h = torch.randn(rows, 64, generator=g)
    ids, logits = head.pick(h)
    assert logits.dtype == torch.bfloat16 and ids is not None
    assert ids.tolist() == _sampler_greedy(logits)
    assert max(ids.tolist()) < 1500
    assert torch.equal(logits, head.logits(h))


def test_model_dtype_head_sends_non_finite_rows_to_the_sampler():
    from grserve.engine.greedy_head import ModelDtypeHead

    w = torch.randn(100, 8).to(torch.bfloat16)
    head = ModelDtypeHead(w)
    h = torch.randn(3, 8)
    h[1, 0] = float("nan")
    ids, logits = head.pick(h)
    assert ids is None and logits.shape == (3, 100)


def test_bf16_engine_greedy_pick_equals_the_sampler(random_decoder):
    """A bf16 model: plain-greedy passes take the executor's max; the same tokens as every pass through the
    sampler (``screened_greedy=False``), and a mixed pass (one sampled row) gives its greedy row the same token."""
    if not cs.cpu_support().fast_paths:
        pytest.skip("GRSERVE_CPU_ISA=reference: full logits + the sampler everywhere")
    from grserve.engine.llm import ModelExecutor, build_model_engine
    from grserve.engine.sampling import SamplingParams
    from grserve.model import ModelSpec
    from grserve.scheduler.fcfs import FCFSScheduler

    spec = ModelSpec(family="qwen3", vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                     tie_word_embeddings=True, attention_bias=False, qk_norm=True, max_position_embeddings=256)
    model = copy.deepcopy(random_decoder(spec, seed=3, std=0.3)).to(torch.bfloat16)  # the fixture's is shared
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12]]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    fast = build_model_engine(model, FCFSScheduler(), num_blocks=64, block_size=4)
    assert fast.executor.dtype_head is not None and fast.executor.greedy_head is None
    assert "bfloat16 logits" in fast.executor.describe()
    calls = []
    orig = fast.executor.dtype_head.pick
    fast.executor.dtype_head.pick = lambda h: calls.append(h.shape[0]) or orig(h)
    want = fast.generate(prompts, sp)
    assert sum(calls) == 3 * 12
    ref = build_model_engine(model, FCFSScheduler(), num_blocks=64, block_size=4)
    ref.executor = ModelExecutor(model, ref.executor.storage, screened_greedy=False)
    assert ref.generate(prompts, sp) == want
    mixed = build_model_engine(model, FCFSScheduler(), num_blocks=64, block_size=4)
    out = mixed.generate(prompts, [sp, sp, SamplingParams(max_tokens=12, temperature=0.8, seed=1,
                                                          ignore_eos=True)])
    assert out[:2] == want[:2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_first_max_is_max_with_the_lowest_index(dtype):
    """``first_max`` (the executor's fast greedy pick) gives ``max(dim=1)``'s indices: exact ties across the row
    (the lowest index), a row of one repeated value, ±0 maxima (equal values, different bits: ``max`` decides),
    -inf entries, one column; fails if the bit search took the last hit or a ±0 tie by its bits."""
    from grserve.engine.greedy_head import first_max

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 4000, generator=g).to(dtype)
    x[0, [17, 2500, 3999]] = 50.0  # tied maximum: index 17
    x[1] = 3.0  # every entry the maximum: index 0
    x[2] = -x[2].abs() - 1
    x[2, 700], x[2, 900] = -0.0, 0.0  # max is zero: -0 first
    x[3, :] = float("-inf")
    x[3, 3000] = -7.0
    x[4, 3998], x[4, 3999] = 60.0, 60.0  # the last two
    for rows in (x, x[:1], x[4:], x[[0, 2]].contiguous()):
        vals = rows.amax(dim=1)
        assert torch.equal(first_max(rows, vals), rows.max(dim=1).indices)
    one = torch.randn(5, 1).to(dtype)
    assert first_max(one, one.amax(dim=1)).tolist() == [0] * 5


def test_the_exact_check_through_scratch_buffers_gives_the_fresh_temporaries_bits():
    """``_exact_dots`` reuses per-thread buffers (no page faults per pass): the same bits as fp64 temporaries, as
    they grow, in and out of inference mode, and past their size cap."""
    from grserve.engine import greedy_head as gh

    g = torch.Generator().manual_seed(9)
    w = torch.randn(700, 40, generator=g)
    head = ScreenedGreedyHead(w, int8=False)
    h = torch.randn(6, 40, generator=g)
    for n, mode in ((5, False), (300, True), (40, False), (2000, True)):
        rows = torch.randint(0, 6, (n,), generator=g)
        cols = torch.randint(0, 700, (n,), generator=g)
        want = (w.index_select(0, cols).double() * h.index_select(0, rows).double()).sum(dim=1)
        with torch.inference_mode(mode):
            got = head._exact_dots(h, rows, cols)
        assert torch.equal(got, want)
    assert head._scratch.bufs[0].shape[0] >= 2000
    old = gh.SCRATCH_ELEMENTS
    try:
        gh.SCRATCH_ELEMENTS = 10  # past the cap: fresh temporaries
        assert torch.equal(head._exact_dots(h, rows, cols), want)
    finally:
        gh.SCRATCH_ELEMENTS = old
