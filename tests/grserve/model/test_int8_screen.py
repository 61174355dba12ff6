"""The int8 screen of the LM head (model/int8_screen.py): fbgemm's dynamic linear returns the exact integer sums
on the grid, the bound holds on every finite row, and the screened greedy head through it is the exact argmax,
row by row whatever shares the pass."""

from __future__ import annotations

import pytest
import torch

from grserve.engine import greedy_head as gh
from grserve.engine.greedy_head import ScreenedGreedyHead
from grserve.model.int8_screen import Int8Screen, fbgemm_available

needs_fbgemm = pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm quantized engine on this CPU/build")


def _exact(h, w):
    return h.double() @ w.double().T


def _rows(g, b, d, spread=3.0):
    """Rows across six orders of magnitude, some with one dominant entry (a coarse grid for the rest)."""
    h = torch.randn(b, d, generator=g) * 10 ** (torch.rand(b, 1, generator=g) * 2 * spread - spread)
    h[::3, 0] *= 50
    return h


@needs_fbgemm
@pytest.mark.parametrize("passes", [1, 2])
def test_the_op_returns_the_integer_sums_bit_for_bit_and_the_bound_holds(passes):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3000, 96, generator=g) * 0.05
    w[7] *= 40  # one large row: its own scale
    screen = Int8Screen(w, passes=passes)
    assert screen.check() is None  # bit for bit against the integer sums (int8_screen.check)
    for b in (1, 2, 5, 33):
        h = _rows(g, b, 96)
        lo, bound = screen.screen(h)
        hs = torch.ldexp(h, -torch.frexp(h.abs().amax(dim=1, keepdim=True)).exponent)  # as the screen scales rows
        err = (lo.double() - _exact(hs, w)).abs().amax(dim=1)
        assert bool((err <= bound.double()).all())
        assert bool((bound > 0).all())
        lo_p, bound_p = screen.screen(h, passes)  # told: the same as the default it was built with
        assert torch.equal(lo_p, lo) and torch.equal(bound_p, bound)
    with pytest.raises(ValueError, match="passes must be 1 or 2"):
        screen.screen(h, 3)


@needs_fbgemm
@pytest.mark.parametrize("scale", [1e-36, 1e-20, 1e20, 1e36])
def test_rows_at_extreme_magnitudes_keep_the_exact_argmax(scale):
    """A row is screened at a power-of-two multiple of itself (no subnormal scales or products), so rows near the
    ends of fp32's range keep the exact argmax."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(2500, 48, generator=g) * 0.05
    head = ScreenedGreedyHead(w, int8=True)
    h = torch.randn(12, 48, generator=g) * scale
    h[0] = w[9] * scale * 3
    assert torch.equal(head.argmax(h), _exact(h, w).argmax(dim=1))
    screen = head.int8
    lo, bound = screen.screen(h)
    hs = torch.ldexp(h, -torch.frexp(h.abs().amax(dim=1, keepdim=True)).exponent)
    assert bool(((lo.double() - _exact(hs, w)).abs().amax(dim=1) <= bound.double()).all())


@needs_fbgemm
def test_a_rows_screen_does_not_depend_on_its_pass():
    """The grid makes the op's per-tensor quantization constant: one row alone and beside others, same bits."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2000, 64, generator=g) * 0.05
    screen = Int8Screen(w)
    h = _rows(g, 9, 64)
    lo, bound = screen.screen(h)
    for i in (0, 4, 8):
        lo1, bound1 = screen.screen(h[i:i + 1])
        assert torch.equal(lo1[0], lo[i]) and torch.equal(bound1[0], bound[i])


@needs_fbgemm
@pytest.mark.parametrize("seed", range(4))
def test_screened_head_through_int8_is_the_exact_argmax(seed):
    g = torch.Generator().manual_seed(seed)
    v, d = 4000, 64
    w = torch.randn(v, d, generator=g) * 0.05
    w[11] = w[5]  # an exact tie: the lowest id
    w[12] = w[5] * (1 + 1e-6)  # a near-tie far below int8 resolution
    head = ScreenedGreedyHead(w, int8=True)
    assert head.int8 is not None and "int8 screen" in head.describe()
    h = _rows(g, 40, d)
    h[3] = w[5] * 4  # rows aimed at the tie and the near-tie
    h[4] = -w[12] * 4
    want = _exact(h, w).argmax(dim=1)
    assert torch.equal(head.argmax(h), want)
    for i in range(0, 40, 7):  # alone: the same token
        assert int(head.argmax(h[i:i + 1])[0]) == int(want[i])
    assert head.stats["exact_rows"] == 0 and head.stats["rows"] > 0


@needs_fbgemm
def test_a_non_finite_row_gets_no_candidates_and_leaves_the_others_exact():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(1500, 32, generator=g) * 0.05
    screen = Int8Screen(w)
    h = torch.randn(4, 32, generator=g)
    bad = h.clone()
    bad[1, 3] = float("nan")
    bad[2, 0] = float("inf")
    lo, bound = screen.screen(bad)
    assert bool(lo[1].isnan().all()) and bool(lo[2].isnan().all()) and bound[1:3].isnan().all()
    ref, _ = screen.screen(h)
    assert torch.equal(lo[0], ref[0]) and torch.equal(lo[3], ref[3])
    head = ScreenedGreedyHead(w, int8=True)
    got = head.argmax(bad)
    want = _exact(h, w).argmax(dim=1)
    assert int(got[0]) == int(want[0]) and int(got[3]) == int(want[3])


@needs_fbgemm
def test_a_disagreeing_op_is_refused_and_the_head_keeps_its_other_path(monkeypatch):
    monkeypatch.setattr(Int8Screen, "check", lambda self: "a trial disagreed")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(500, 32, generator=g) * 0.05
    head = ScreenedGreedyHead(w, int8=True)
    assert head.int8 is None and head.int8_refused == "a trial disagreed"
    assert "int8" not in head.describe()
    h = torch.randn(5, 32, generator=g)
    assert torch.equal(head.argmax(h), _exact(h, w).argmax(dim=1))


@needs_fbgemm
def test_the_timed_choice_is_per_pass_size_and_taken_once_per_shape(monkeypatch):
    monkeypatch.setattr(gh, "_INT8_TIMED", {})
    calls = []

    def fake_time(self):
        calls.append(1)
        self.int8_at = {1: True, 8: False, 32: False}

    monkeypatch.setattr(ScreenedGreedyHead, "_time_int8", fake_time)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(800, 32, generator=g) * 0.05
    head = ScreenedGreedyHead(w)
    assert [head._int8_probe(r) is not None for r in (1, 2, 8, 9, 64)] == [True, False, False, False, False]
    assert "at passes like [1] rows" in head.describe() and "grid" not in head.describe()
    head.int8_grids = {1: 1}
    assert "one grid per row at passes like [1] rows" in head.describe()
    ScreenedGreedyHead(w)
    assert len(calls) == 1  # the second head of the shape reuses the timing
    monkeypatch.setattr(ScreenedGreedyHead, "_time_int8", lambda self: self.int8_at.update({1: False, 8: False,
                                                                                            32: False}))
    monkeypatch.setattr(gh, "_INT8_TIMED", {})
    slow = ScreenedGreedyHead(w)
    assert slow.int8 is None and "int8" not in slow.describe()


def test_reference_level_has_no_int8_screen(forced_cpu_isa):
    forced_cpu_isa("reference")
    assert not fbgemm_available()
    w = torch.randn(300, 16)
    assert ScreenedGreedyHead(w, int8=True).int8 is None


@needs_fbgemm
def test_a_burst_of_slow_passes_does_not_drop_a_pass_size(monkeypatch):
    """A busy moment of the machine (fewer than ``INT8_STRIKES`` slow passes of the last ``INT8_WATCH``) keeps
    the int8 screen; a steady majority of slow passes drops it."""
    monkeypatch.setattr(gh, "_INT8_TIMED", {})

    def timed(self):
        self.int8_at = {1: True, 8: True, 32: True}
        self.int8_base = {1: 1.0, 8: 1.0, 32: 1.0}

    monkeypatch.setattr(ScreenedGreedyHead, "_time_int8", timed)
    head = ScreenedGreedyHead(torch.randn(300, 16) * 0.05)
    slow = [2.0] * (gh.INT8_STRIKES - 1) + [0.5] * (gh.INT8_WATCH - gh.INT8_STRIKES + 1)
    for seconds in slow * 3:  # a burst at every window position
        head._watch(8, seconds)
    assert head._int8_probe(8) is not None and "int8_dropped" not in head.stats
    for _ in range(gh.INT8_STRIKES):
        head._watch(8, 2.0)
    assert head._int8_probe(8) is None and head._int8_probe(1) is not None and head.stats["int8_dropped"] == 1


@needs_fbgemm
def test_a_pass_size_whose_int8_passes_run_slower_than_the_other_path_goes_back_to_it(monkeypatch):
    """The start-up timing's random rows can hide a model whose flat logits leave many candidates: a pass size
    whose int8 passes keep taking longer than the other path did at start-up is dropped; tokens stay exact."""
    monkeypatch.setattr(gh, "_INT8_TIMED", {})

    def timed(self):
        self.int8_at = {1: True, 8: True, 32: True}
        self.int8_base = {1: 10.0, 8: 1e-9, 32: 10.0}  # the other path "took" 1 ns at 8 rows: int8 always slower

    monkeypatch.setattr(ScreenedGreedyHead, "_time_int8", timed)
    g = torch.Generator().manual_seed(6)
    w = torch.randn(900, 32, generator=g) * 0.05
    head = ScreenedGreedyHead(w)
    for i in range(gh.INT8_WATCH + 2):
        assert (head._int8_probe(6) is not None) == (i < gh.INT8_WATCH)
        h = torch.randn(6, 32, generator=g)
        assert torch.equal(head.argmax(h), _exact(h, w).argmax(dim=1))
    h = torch.randn(1, 32, generator=g)
    assert torch.equal(head.argmax(h), _exact(h, w).argmax(dim=1))
    assert head._int8_probe(6) is None and head._int8_probe(1) is not None and head.stats["int8_dropped"] == 1


@needs_fbgemm
def test_one_grid_bands_too_wide_are_screened_again_with_two_and_the_pass_size_then_starts_with_two(monkeypatch):
    """With the untimed limit at one candidate a row (``REFINE_SHARE`` = the vocabulary), random rows leave more
    one-grid candidates than that: each such pass is screened again with two grids, and after ``WIDE_AFTER`` of
    them its size starts with two; the tokens are the exact argmax throughout."""
    g = torch.Generator().manual_seed(7)
    v, d = 3000, 64
    monkeypatch.setattr(gh, "REFINE_SHARE", v)
    w = torch.randn(v, d, generator=g) * 0.05
    head = ScreenedGreedyHead(w, int8=True)  # untimed: one grid first at every pass size
    assert head.int8_grids == {1: 1, 8: 1, 32: 1}
    for i in range(gh.WIDE_AFTER + 2):
        h = torch.randn(8, d, generator=g)
        h[:, 0] *= 50  # a dominant entry: a coarse grid for the rest, a wide one-grid band
        assert torch.equal(head.argmax(h), _exact(h, w).argmax(dim=1))
        assert head.stats["int8_rescreened"] == min(i + 1, gh.WIDE_AFTER)
    assert head.int8_grids[8] == 2 and head.stats["int8_to_two_grids"] == 1
    assert head.int8_grids[1] == 1 and head.int8_grids[32] == 1  # other pass sizes keep their own
    assert "int8_too_wide" not in head.stats  # two grids: within the scratch buffers


@needs_fbgemm
def test_a_one_grid_band_within_the_limit_is_checked_as_it_is():
    """A row far from every other logit (aimed at one weight row) leaves few one-grid candidates: no second
    screen."""
    g = torch.Generator().manual_seed(8)
    v, d = 3000, 64
    w = torch.randn(v, d, generator=g) * 0.05
    head = ScreenedGreedyHead(w, int8=True)
    h = w[torch.randint(0, v, (8,), generator=g)] * 40
    assert torch.equal(head.argmax(h), _exact(h, w).argmax(dim=1))
    assert "int8_rescreened" not in head.stats and head.stats["candidates"] < 8 * v // gh.REFINE_SHARE


def _timed(int8_grids, base, dot_seconds):
    def timed(self):
        self.int8_at = {1: True, 8: True, 32: True}
        self.int8_base = dict(base)
        self.int8_two_grid_time = dict(base)
        self.int8_grids = dict(int8_grids)
        self.dot_seconds = dot_seconds
    return timed


@needs_fbgemm
def test_a_two_grid_band_too_wide_for_its_check_takes_the_other_path_and_then_leaves_the_int8_screen(monkeypatch):
    """200 identical weight rows: a row aimed at them has 200 exact candidates whatever the screen. With the
    exact check timed at 1 s an element no pass may check more than one candidate a row: each such pass takes the
    other path (the same tokens), and after ``WIDE_AFTER`` of them its size leaves the int8 screen."""
    monkeypatch.setattr(gh, "_INT8_TIMED", {})
    monkeypatch.setattr(ScreenedGreedyHead, "_time_int8", _timed({1: 2, 8: 2, 32: 2}, {1: 1.0, 8: 1.0, 32: 1.0},
                                                                  1.0))
    g = torch.Generator().manual_seed(9)
    v, d = 2000, 32
    w = torch.randn(v, d, generator=g) * 0.05
    w[1:200] = w[0]
    head = ScreenedGreedyHead(w)
    assert head._dots_limit(8, 2, torch.zeros(6, d)) == 6  # at least one candidate a row
    for i in range(gh.WIDE_AFTER + 1):
        assert (head._int8_probe(6) is not None) == (i < gh.WIDE_AFTER)
        h = torch.randn(6, d, generator=g)
        h[0] = w[0] * 5
        assert torch.equal(head.argmax(h), _exact(h, w).argmax(dim=1))
    assert head.stats["int8_too_wide"] == gh.WIDE_AFTER and head.stats["int8_dropped"] == 1
    assert head._int8_probe(1) is not None  # a 1-row pass aimed elsewhere: its own size, kept
    forced = ScreenedGreedyHead(w, int8=True)  # int8=True: every pass size, never dropped
    forced.dot_seconds, forced.int8_base = 1.0, {}
    for _ in range(gh.WIDE_AFTER + 1):
        h = w[:6] * 5
        assert torch.equal(forced.argmax(h), _exact(h, w).argmax(dim=1))
    assert forced._int8_probe(6) is not None


@needs_fbgemm
def test_the_limits_follow_the_timed_costs(monkeypatch):
    """The exact check may spend what screening again (one grid) or the other path (two grids) took at start-up,
    at its own rate per element, within the scratch buffers."""
    monkeypatch.setattr(gh, "_INT8_TIMED", {})
    monkeypatch.setattr(ScreenedGreedyHead, "_time_int8", _timed({1: 1, 8: 1, 32: 1}, {1: 1e-3, 8: 2e-3, 32: 8e-3},
                                                                  1e-8))
    w = torch.randn(5000, 100) * 0.05
    head = ScreenedGreedyHead(w)
    head.int8_two_grid_time = {1: 0.5e-3, 8: 1e-3, 32: 4e-3}
    h = torch.zeros(8, 100)
    assert head._dots_limit(8, 1, h) == 1000  # 1 ms / (10 ns × 100)
    assert head._dots_limit(8, 2, h) == 2000
    assert head._dots_limit(32, 2, torch.zeros(32, 100)) == min(8000, gh.SCRATCH_ELEMENTS // 100)
    head.dot_seconds = 1e-15
    assert head._dots_limit(8, 2, h) == gh.SCRATCH_ELEMENTS // 100


@needs_fbgemm
def test_the_start_up_timing_sets_every_probe_size(monkeypatch):
    """The real timing on a small head: a decision, a number of grids and both times for every probe size, and
    the exact check's rate."""
    monkeypatch.setattr(gh, "_INT8_TIMED", {})
    head = ScreenedGreedyHead(torch.randn(4096, 64) * 0.05)
    if head.int8 is None:  # slower than the other path everywhere here: nothing else to check
        return
    assert set(head.int8_at) == set(head.int8_grids) == set(head.int8_base) == set(head.int8_two_grid_time) \
        == set(gh.INT8_PROBE_ROWS)
    assert set(head.int8_grids.values()) <= {1, 2} and head.dot_seconds > 0
    assert head.stats == {"rows": 0, "candidates": 0, "exact_rows": 0} and not head._recent
