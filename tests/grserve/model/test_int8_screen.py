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
    assert "at passes like [1] rows" in head.describe()
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
