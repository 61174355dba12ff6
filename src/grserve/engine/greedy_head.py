"""Exact greedy token choice with a bf16 screen of the LM head.

For greedy decoding only the argmax of ``h · Wᵀ`` (fp32) is needed, not the logits. At batch 32 on a CPU the fp32
LM head GEMM [32 × d] × [d × V] is the largest single cost of a decode step (tiny: 32k vocab, ≈ half the step),
and bf16 GEMMs run ≈ 3× faster. So:

1. screen: ``lo = bf16(h) · bf16(W)ᵀ`` (the bf16 weight copy is made once);
2. bound the screen's error per row: ``|lo_j − exact_j| ≤ E`` with
   ``E = 2 · (2.5·u·‖h‖₂·max_j ‖w_j‖₂ + u·max_j |lo_j|)``, u = 2⁻⁸ (bf16 unit roundoff): rounding h and w to
   bf16 perturbs each product by ≤ (2u + u²)|h_i w_ji|, Σ_i |h_i w_ji| ≤ ‖h‖‖w_j‖ (Cauchy–Schwarz), fp32
   accumulation of d terms adds ≤ d·2⁻²⁴ relative (< 0.5u for d ≤ 2¹⁵), the bf16 output rounding ≤ u·|lo_j|;
   the factor 2 is slack;
3. candidates: every j with ``lo_j ≥ max lo − 2E`` (the true argmax is always among them). They are found from
   the maxima of the screen's 128-token chunks (``band="chunks"``, the default: one fp32 copy of the screen and
   one ``amax`` over it, ≈ 6× cheaper than ``topk`` over a 32k vocabulary on bf16): a row whose band holds one
   chunk, and in that chunk one token, has its answer; any other row (rare) scans its row for the band. The
   screen's top k (``band="topk"``, one ``topk`` pass; a scan when the k-th is still inside the band) is the
   reference; a test checks they agree. With two or more candidates their logits are recomputed exactly in fp32
   and the largest wins (ties: the lowest index, as ``torch.argmax``). ``max_j |lo_j|`` is bounded by
   ``(1 + 3u)·‖h‖·max‖w_j‖`` to avoid another pass.

The result is the fp32 argmax up to the rounding of the fp32 dot products themselves, the same caveat as between
any two fp32 GEMM kernels (HF's and ours). Used by ``ModelExecutor`` when every sampled row of a pass is greedy;
sampling with temperature > 0 computes the full fp32 logits as before.

Which GEMMs run is chosen by what the CPU can do (``model/cpu_support.py``), since bf16 is fast only on some:

* fast bf16 (AVX-512 BW/VL/DQ, AVX-NE-CONVERT): the screen on a oneDNN-packed bf16 copy, at every row count;
* no fast bf16 (AVX2 x86, most laptops, AMD before Zen 4): oneDNN refuses a bf16 reorder, and torch's own bf16
  GEMM is 1.5-4x *slower* than fp32 from 4 rows up, but it reads half the bytes, so the memory-bound 1-2-row
  products still gain. The screen (``F.linear`` in bf16, fp32 accumulation: the same bound) runs up to
  ``screen_max_rows`` = 2 rows; larger passes take the exact fp32 argmax on a oneDNN-packed fp32 copy of the
  head (1.4-2.2x ``F.linear`` at 4-32 rows; measured in docs/llm.md, "On CPUs without fast bf16");
* no oneDNN, or a GPU: the screen through ``F.linear``.

Where fbgemm runs (x86 with AVX2, ``model/int8_screen.py``), an int8 screen with its own exact bound is timed
against the path above at start-up, at 1, 8 and 32 rows (once per head shape per process), and takes the pass
sizes where it is ``INT8_MIN_SPEEDUP`` x faster (a pass takes the decision of the smallest probe size that holds
it); a pass size whose int8 passes then run ``INT8_SLOW`` x slower than the other path did at start-up goes back to
it (``_watch``: flat logits leave many candidates, which random rows do not show). Where the start-up timing finds it
faster (the op compute-bound: 8 rows and more on an AVX2 CPU) the int8 screen starts with one grid per row, not
two (``Int8Screen.screen(h, passes=1)``: half the op's rows, a wider band). Before the exact check the pass's
candidates are counted (``_pick_chunks``'s ``limit``): where checking them would cost more than screening again
with two grids (one grid) or than the other path (two grids), at the exact check's own start-up rate per element,
the pass is screened again with two grids or goes to the other path; a pass size where that happened in
``WIDE_AFTER`` of its last ``WIDE_WATCH`` passes starts with two grids, or leaves the int8 screen, from then on
(``_often``). The candidates and their exact fp64 check are the same whichever screen found them.
``GRSERVE_CPU_ISA=reference`` turns the head off (``ModelExecutor`` then takes the full logits' argmax).
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque

import numpy as np
import torch
import torch.nn.functional as F

from grserve.model.int8_screen import Int8Screen, fbgemm_available
from grserve.model.dtype_choice import best_time
from grserve.model.packed_linear import available, pack_weight, packed_matmul

U_BF16 = 2.0 ** -8
CHUNK = 128  # tokens per chunk of the candidate search (band="chunks")
SLOW_BF16_SCREEN_ROWS = 2  # without fast bf16: the screen only up to this many rows (docs/llm.md)
ALL_ROWS = 2 ** 62
INT8_PROBE_ROWS = (1, 8, 32)  # pass sizes at which the int8 screen is timed against the other path at start-up
INT8_MIN_SPEEDUP = 1.1  # ... and taken where it is this much faster
INT8_WATCH, INT8_STRIKES = 64, 48  # ... and dropped where 48 of the last 64 passes were slow:
INT8_SLOW = 1.5  # ... over 1.5x the other path's start-up time (a served step runs beside a front end and client)
EVICT_BYTES = 64 << 20  # ... each call timed after this much other data went through the caches (_time_int8)
ONE_GRID_MIN_SPEEDUP = 1.1  # the int8 screen's one-grid pass where start-up finds it this much faster than two
WIDE_WATCH, WIDE_AFTER = 16, 4  # a pass size whose bands were too wide in 4 of its last 16: two grids / other path
REFINE_SHARE = 256  # untimed (int8=True): a one-grid band of more than 1/256 of the screen's entries: two grids
_INT8_TIMED: dict[tuple, dict] = {}  # key -> the timed attributes (_TIMED_ATTRS)
_TIMED_ATTRS = ("int8_at", "int8_base", "int8_grids", "int8_two_grid_time", "dot_seconds")
SCRATCH_ELEMENTS = 2 ** 22  # the exact check's scratch buffers: at most this many elements each (32 MiB of fp64)


class ScreenedGreedyHead:
    def __init__(self, weight: torch.Tensor, screen_max_rows: int | None = None, band: str = "chunks",
                 int8: bool | None = None):
        """``screen_max_rows``: passes of more rows take the exact fp32 argmax instead of the screen (None: by
        what the CPU can do, see the module docstring). ``band``: how the candidates are found, ``"chunks"``
        (chunk maxima) or ``"topk"`` (the reference). ``int8``: the int8 screen (``model/int8_screen.py``) where
        fbgemm runs and its check passes: None takes it at the pass sizes where a start-up timing finds it
        ``INT8_MIN_SPEEDUP`` x faster than the path above, True at every pass size, False never."""
        if band not in ("chunks", "topk"):
            raise ValueError(f"band must be 'chunks' or 'topk', not {band!r}")
        self.band = band
        if weight.dtype != torch.float32:
            raise ValueError("the screened greedy head is for fp32 weights")
        if weight.shape[1] > 2 ** 15:
            raise ValueError("hidden size too large for the accumulation bound")
        self.weight = weight
        self.weight_lo = weight.detach().to(torch.bfloat16).contiguous()
        cpu = weight.device.type == "cpu"
        # the screen's GEMM on a oneDNN-packed copy where the CPU has fast bf16 (1.1-4x faster at 1-32 rows;
        # the same bf16 products accumulated in fp32, so the bound below is unchanged); F.linear otherwise
        self.weight_lo_packed = None
        self.weight_packed = None  # oneDNN-packed fp32 copy: the exact path of larger passes without fast bf16
        with torch.inference_mode():
            if cpu and available(torch.bfloat16):
                self.weight_lo_packed = pack_weight(self.weight_lo)
            elif cpu and available(torch.float32):
                self.weight_packed = pack_weight(weight)
        if screen_max_rows is None:
            screen_max_rows = SLOW_BF16_SCREEN_ROWS if cpu and self.weight_lo_packed is None else ALL_ROWS
        self.screen_max_rows = screen_max_rows
        self.max_row_norm = float(weight.detach().norm(dim=1).max())
        # rows screened; candidates recomputed exactly (≥ 1 per screened row); rows of the exact fp32 path
        self.stats = {"rows": 0, "candidates": 0, "exact_rows": 0}
        self._scratch = threading.local()  # the exact check's buffers (_exact_dots)
        self.int8: Int8Screen | None = None
        self.int8_at: dict[int, bool] = {}  # probe rows -> the int8 screen runs passes of up to that size
        self.int8_base: dict[int, float] = {}  # probe rows -> the other path's start-up time (seconds)
        self.int8_grids: dict[int, int] = {}  # probe rows -> grids per row the int8 screen starts with (1 or 2)
        self.int8_two_grid_time: dict[int, float] = {}  # probe rows -> the two-grid int8 screen's start-up time
        self.dot_seconds: float | None = None  # the exact check's start-up time per element (candidates × d)
        self._recent: dict[tuple, deque] = {}  # what _watch and the band limits saw of recent passes (_often)
        self.int8_refused = ""
        if cpu and int8 is not False and fbgemm_available():
            self._choose_int8(int8)

    def _choose_int8(self, forced: bool | None) -> None:
        screen = Int8Screen(self.weight)
        why = screen.check()
        if why is not None:
            self.int8_refused = why
            return
        self.int8 = screen
        if forced:  # every pass size, one grid first (the path with the most branches)
            self.int8_at = {r: True for r in INT8_PROBE_ROWS}
            self.int8_grids = {r: 1 for r in INT8_PROBE_ROWS}
            return
        key = (*self.weight.shape, self.screen_max_rows, self.weight_lo_packed is not None, torch.get_num_threads())
        if key in _INT8_TIMED:  # one timing per head shape and path per process (engines are rebuilt in tests)
            for name in _TIMED_ATTRS:
                setattr(self, name, copy.copy(_INT8_TIMED[key][name]))
        else:
            self._time_int8()
            _INT8_TIMED[key] = {name: copy.copy(getattr(self, name)) for name in _TIMED_ATTRS}
        if not any(self.int8_at.values()):
            self.int8 = None

    def _time_int8(self) -> None:
        """Each path timed as a decode step meets it: the caches refilled by ``EVICT_BYTES`` of other data before
        every timed call (the step's other weights and K/V pass through them between two heads). Timed back to
        back instead, the int8 head (a quarter of the fp32 head's bytes) stays in a 32 MB L3 and the start-up
        times were optimistic for it, which the watch below then compared the int8 passes of real steps to. The
        int8 screen is timed with one grid and with two; the one-grid pass is taken where it is
        ``ONE_GRID_MIN_SPEEDUP`` x faster (random rows leave few candidates either way). The exact check is timed
        per element, for the limits of ``_dots_limit``."""
        g = torch.Generator().manual_seed(0)
        other = torch.zeros(min(EVICT_BYTES, 16 * self.weight.numel() * 4) // 4)  # (a small head: less)

        def evict() -> None:
            other.add_(1.0)

        with torch.inference_mode():
            for rows in INT8_PROBE_ROWS:
                h = torch.randn(rows, self.weight.shape[1], generator=g)
                self.int8_at[rows] = False
                base = best_time(lambda h=h: self.argmax(h), 3, before=evict)
                self.int8_at[rows] = True
                took = {}
                for grids in (2, 1):
                    self.int8_grids[rows] = grids
                    took[grids] = best_time(lambda h=h: self.argmax(h), 3, before=evict)
                grids = 1 if took[2] >= ONE_GRID_MIN_SPEEDUP * took[1] else 2
                self.int8_grids[rows] = grids
                self.int8_at[rows] = base >= INT8_MIN_SPEEDUP * took[grids]
                self.int8_base[rows] = base
                self.int8_two_grid_time[rows] = took[2]
            v, d = self.weight.shape
            n = max(1, min(4096, SCRATCH_ELEMENTS // d))
            h = torch.randn(INT8_PROBE_ROWS[-1], d, generator=g)
            at = torch.randint(0, h.shape[0], (n,), generator=g).sort().values  # candidates by row, as a pass's
            cols = torch.randint(0, v, (n,), generator=g)
            self.dot_seconds = best_time(lambda: self._exact_dots(h, at, cols), 3, before=evict) / (n * d)
        self.stats = {"rows": 0, "candidates": 0, "exact_rows": 0}
        self._recent.clear()

    def _int8_probe(self, rows: int) -> int | None:
        """The probe size whose decision a pass of ``rows`` rows takes (the smallest that holds it, the largest
        for bigger passes) when that decision is the int8 screen; None otherwise."""
        if self.int8 is None:
            return None
        probe = next((r for r in INT8_PROBE_ROWS if rows <= r), INT8_PROBE_ROWS[-1])
        return probe if self.int8_at.get(probe, False) else None

    def _watch(self, probe: int, seconds: float) -> None:
        """The start-up timing ran on random rows, whose screens leave few candidates; a model with flat logits
        leaves many (docs/llm.md: ~190 a row on the medium shape's random weights), and their exact check can
        cost more than the screen saves (``_dots_limit`` catches that before the check; this is the last resort).
        A pass size whose int8 passes take longer than ``INT8_SLOW`` x what the other path took at start-up for
        the probe's (larger or equal) row count in ``INT8_STRIKES`` of the last ``INT8_WATCH`` goes back to the
        other path, for good. The margin: start-up times are best cases on a quiet process, and a served step
        shares caches and memory bandwidth with the front end and the client; without it a served tiny model
        dropped the one-grid screen at 32 rows (its passes ~10 ms against a 9.8 ms start-up time for the packed
        fp32 head, which took 11.1 ms a pass there itself)."""
        base = self.int8_base.get(probe)
        if base is None:  # forced on (int8=True): not watched
            return
        if self._often(("slow", probe), seconds > INT8_SLOW * base, INT8_WATCH, INT8_STRIKES, whole_window=True):
            self._drop(probe)

    def _often(self, key: tuple, event: bool, window: int, needed: int, whole_window: bool = False) -> bool:
        """Notes ``event`` for ``key``; True (and forgets the window) when it happened in ``needed`` of the last
        ``window`` (``whole_window``: only once ``window`` are noted). The band limits note, per pass size and
        grids, whether a band was too wide for its exact check: ``WIDE_AFTER`` of ``WIDE_WATCH``, so a model
        whose logits are flat pays a wasted screen only a few times."""
        seen = self._recent.setdefault(key, deque(maxlen=window))
        seen.append(event)
        if sum(seen) < needed or (whole_window and len(seen) < window):
            return False
        seen.clear()
        return True

    def _drop(self, probe: int) -> None:
        """The pass size goes back to the other path, for good."""
        self.int8_at[probe] = False
        self._count("int8_dropped")

    def _count(self, name: str) -> None:
        self.stats[name] = self.stats.get(name, 0) + 1

    def _dots_limit(self, probe: int, grids: int, h: torch.Tensor) -> int:
        """The most candidates a pass screened with ``grids`` grids sends to the exact check: what the check may
        cost at its start-up rate per element is what screening again with two grids (from one) or the other
        path (from two) took at start-up for the probe size, and its elements fit the scratch buffers. Untimed
        (``int8=True``): ``1/REFINE_SHARE`` of the screen's entries from one grid, the buffers from two."""
        b, d = h.shape
        v = self.weight.shape[0]
        cap = SCRATCH_ELEMENTS // d
        spend = (self.int8_two_grid_time if grids == 1 else self.int8_base).get(probe)
        if self.dot_seconds is None or spend is None:
            return max(b, min(cap, b * v // REFINE_SHARE)) if grids == 1 else max(b, cap)
        return max(b, min(cap, int(spend / (self.dot_seconds * d))))

    def describe(self) -> str:
        """For the start line: which GEMMs pick the greedy token on this machine."""
        other = self._describe_other()
        if self.int8 is None:
            return other
        sizes = [r for r in INT8_PROBE_ROWS if self.int8_at.get(r)]
        one = [r for r in sizes if self.int8_grids.get(r) == 1]
        grids = f"; one grid per row at passes like {one} rows, two where its band is wide" if one else ""
        screen = f"int8 screen (fbgemm{grids}) + exact fp64 check"
        if len(sizes) == len(INT8_PROBE_ROWS):
            return screen
        return f"{screen} at passes like {sizes} rows, else {other}"

    def _describe_other(self) -> str:
        exact = "fp32 (oneDNN-packed)" if self.weight_packed is not None else "fp32"
        if self.weight_lo_packed is not None:
            return "bf16 screen (oneDNN-packed) + exact fp32 check"
        if self.screen_max_rows >= ALL_ROWS:
            return "bf16 screen (F.linear) + exact fp32 check"
        if self.screen_max_rows <= 0:
            return exact
        return f"bf16 screen up to {self.screen_max_rows} rows, else {exact} (no fast bf16 on this CPU)"

    def exact_argmax(self, h: torch.Tensor) -> torch.Tensor:
        """The fp32 argmax of ``h · Wᵀ`` without a screen (ties: the lowest index, as ``torch.argmax``)."""
        self.stats["exact_rows"] += h.shape[0]
        if self.weight_packed is not None:
            logits = packed_matmul(h, self.weight_packed)
        else:
            logits = F.linear(h, self.weight)
        return logits.argmax(dim=1)

    def argmax(self, hidden: torch.Tensor, k: int = 8) -> torch.Tensor:
        """hidden fp32 [B, d] → int64 [B], the argmax over the vocabulary of ``hidden · Wᵀ``."""
        h = hidden.float()
        probe = self._int8_probe(h.shape[0])
        if probe is None:
            return self._argmax(h, k)
        t0 = time.perf_counter()
        out = self._argmax_int8(h, k, probe)
        self._watch(probe, time.perf_counter() - t0)
        return out

    def _argmax(self, h: torch.Tensor, k: int) -> torch.Tensor:
        if h.shape[0] > self.screen_max_rows:
            return self.exact_argmax(h)
        hb = h.to(torch.bfloat16)
        if self.weight_lo_packed is not None:
            lo = packed_matmul(hb, self.weight_lo_packed)  # [B, V] bf16
        else:
            lo = F.linear(hb, self.weight_lo)  # [B, V] bf16
        # |lo_j| ≤ (1 + 3u)·‖h‖·max‖w_j‖ (Cauchy–Schwarz), so the error bound needs no pass over lo
        hw = h.norm(dim=1) * self.max_row_norm
        bound = 2.0 * (2.5 * U_BF16 * hw + U_BF16 * (1 + 3 * U_BF16) * hw)
        return self._pick(h, lo, bound, k)

    def _argmax_int8(self, h: torch.Tensor, k: int, probe: int) -> torch.Tensor:
        """The int8 screen with the probe size's grids per row. A band too wide for its exact check
        (``_dots_limit``): from one grid the pass is screened again with two, from two it takes the other path;
        a pass size where that keeps happening starts with two grids, or leaves the int8 screen (``_often``)."""
        assert self.int8 is not None
        grids = self.int8_grids.get(probe, 2)
        lo, bound = self.int8.screen(h, grids)
        out = self._pick(h, lo, bound, k, self._dots_limit(probe, grids, h))
        if grids == 1:
            if self._often(("wide", probe, 1), out is None, WIDE_WATCH, WIDE_AFTER):
                self.int8_grids[probe] = 2
                self._count("int8_to_two_grids")
            if out is not None:
                return out
            self._count("int8_rescreened")
            lo, bound = self.int8.screen(h, 2)
            out = self._pick(h, lo, bound, k, self._dots_limit(probe, 2, h))
        if self._often(("wide", probe, 2), out is None, WIDE_WATCH, WIDE_AFTER) and probe in self.int8_base:
            self._drop(probe)  # (int8=True, no start-up times: every pass size, kept)
        if out is not None:
            return out
        self._count("int8_too_wide")
        return self._argmax(h, k)

    def _pick(self, h: torch.Tensor, lo: torch.Tensor, bound: torch.Tensor, k: int,
              limit: int | None = None) -> torch.Tensor | None:
        """The tokens from a screen and its bound (None: more than ``limit`` candidates, chunk band only)."""
        if lo.shape[1] == 1:  # a one-token vocabulary
            return torch.zeros(h.shape[0], dtype=torch.int64, device=h.device)
        out = self._pick_topk(h, lo, bound, k) if self.band == "topk" else self._pick_chunks(h, lo, bound, limit)
        if out is not None:
            self.stats["rows"] += h.shape[0]
        return out

    def _pick_chunks(self, h: torch.Tensor, lo: torch.Tensor, bound: torch.Tensor,
                     limit: int | None = None) -> torch.Tensor | None:
        """The band from the screen's per-chunk maxima, for every row at once: the (row, chunk) pairs whose chunk
        maximum is in the row's band, the tokens of those chunks in the band; a row with one such token has its
        answer, rows with more get their candidates' exact logits (fp64, as ``_best``) and the largest, the
        lowest id on ties (segment max and min over the flat candidate list: no per-row Python). With ``limit``:
        None as soon as the pass has more candidates than that (the chunks in the band count first: each holds at
        least one)."""
        b, v = lo.shape
        c = -(-v // CHUNK)
        if c * CHUNK == v:
            x = lo.float().view(b, c, CHUNK)
        else:  # the last chunk padded with -inf (never in a band: the band's floor is finite)
            x = torch.full((b, c * CHUNK), float("-inf"), device=lo.device)
            x[:, :v] = lo
            x = x.view(b, c, CHUNK)
        cmax = x.amax(dim=2)  # [B, C]
        floor = cmax.amax(dim=1) - 2.0 * bound  # [B]
        row, chunk = torch.nonzero(cmax >= floor[:, None], as_tuple=True)  # row-major: rows ascending
        if limit is not None and row.numel() > limit:
            return None
        p, j = torch.nonzero(x[row, chunk] >= floor[row, None], as_tuple=True)
        if limit is not None and p.numel() > limit:
            return None
        rows, cols = row[p], chunk[p] * CHUNK + j  # the candidates, by row then id
        self.stats["candidates"] += int(cols.numel())
        per_row = torch.bincount(rows, minlength=b)  # 0 only for a row without candidates (NaN in h)
        if bool((per_row == 1).all()):  # one candidate per row: the answers
            return cols
        exact = self._exact_dots(h, rows, cols)
        best = torch.full((b,), float("-inf"), dtype=exact.dtype, device=h.device)
        best = best.scatter_reduce(0, rows, exact, "amax")
        win = exact == best[rows]
        out = torch.zeros(b, dtype=torch.int64, device=h.device).scatter_reduce(0, rows[win], cols[win], "amin",
                                                                                   include_self=False)
        bare = per_row == 0
        if bool(bare.any()):  # a row without candidates (NaN in h): its screen row's argmax (all NaN: id 0, the
            # sampler's answer for NaN logits); only there: argmax over [B, V] costs ~1 ms at 32 x 32k rows
            out[bare] = x.view(b, -1)[bare].argmax(dim=1)
        return out

    def _exact_dots(self, h: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """fp64 ``h[rows_i] · w[cols_i]`` for every candidate i (exact products of fp32 values, one reduction
        order). On a CPU through scratch buffers kept per thread across passes: fresh [n, d] fp64 temporaries cost
        a page fault per 4 KiB when first written (≈ 4 µs a candidate at d = 256, most of a pass with ~40
        candidates per row); the same ops, so the same bits."""
        n, d = cols.numel(), h.shape[1]
        if h.device.type != "cpu" or n * d > SCRATCH_ELEMENTS:
            return (self.weight.index_select(0, cols).double() * h.index_select(0, rows).double()).sum(dim=1)
        buf = getattr(self._scratch, "bufs", None)
        if buf is None or buf[0].shape[0] < n or buf[0].shape[1] != d:
            cap = min(max(n, 2 * (buf[0].shape[0] if buf is not None else 256)), max(n, SCRATCH_ELEMENTS // d))
            with torch.inference_mode(False):  # normal tensors: written in place in and out of inference mode
                buf = (torch.empty(cap, d), torch.empty(cap, d, dtype=torch.float64),
                       torch.empty(cap, d, dtype=torch.float64))
            self._scratch.bufs = buf
        w32, w64, h64 = buf[0][:n], buf[1][:n], buf[2][:n]
        torch.index_select(self.weight, 0, cols, out=w32)
        w64.copy_(w32)
        torch.index_select(h.double(), 0, rows, out=h64)
        return w64.mul_(h64).sum(dim=1)

    def _pick_topk(self, h: torch.Tensor, lo: torch.Tensor, bound: torch.Tensor, k: int) -> torch.Tensor:
        """The reference band search: the screen's top k per row (a row scan when the k-th is in the band)."""
        vals, idx = lo.topk(min(k, lo.shape[1]), dim=1)  # one pass; the screen's top k per row
        vals = vals.float()
        floor = vals[:, 0] - 2.0 * bound
        cand = vals >= floor[:, None]  # [B, k]; column 0 always
        out = idx[:, 0].clone()  # rows whose band holds one candidate: the screen's top is the answer
        self.stats["candidates"] += int((~cand[:, 1]).sum())
        # rows with more candidates (rare): exact fp32 logits of the band, from the top k or, when the band may
        # extend past it, from a scan of the whole row
        for r in torch.nonzero(cand[:, 1]).flatten().tolist():
            cols = torch.nonzero(lo[r].float() >= floor[r]).flatten() if cand[r, -1] else idx[r][cand[r]]
            out[r] = self._best(h[r], cols)
        return out

    def _best(self, h: torch.Tensor, cols: torch.Tensor) -> int:
        """The argmax of the exact logits among ``cols`` (≥ 2 candidates; ties: the lowest index). The dot products
        are taken in fp64 (exact products of fp32 values, one reduction order for every row): a matrix-vector
        product in fp32 may round two identical weight rows differently (MKL's sgemv did, 1 ulp), which broke
        an exact tie the wrong way."""
        self.stats["candidates"] += int(cols.numel())
        cols, _ = cols.sort()
        exact = (self.weight.index_select(0, cols).double() * h.double()).sum(dim=1)
        return int(cols[int(exact.argmax())])


class ModelDtypeHead:
    """The LM head of a model whose weights are not fp32 (bf16), and its greedy pick.

    ``logits(h)``: the logits at the model's dtype, on a oneDNN-packed copy of the head where the CPU has fast
    arithmetic in that dtype (``model/packed_linear.py``'s rule; 1.5–4× ``F.linear`` at 1–32 rows on the 2-core
    AVX-512 dev VM), else ``F.linear``. The executor takes every logit of such a model from here, greedy and
    sampled passes alike, so a row's logits do not depend on what its pass holds.

    ``pick(h)``: the greedy tokens straight from those logits, each row's maximum at the model's dtype (the lowest
    id on ties; ``first_max``) — the token the sampler's float64 argmax over the same logits chooses, without its
    float64 pass (≈ 10 ms per step at 32 rows on the tiny preset). A row whose maximum is not finite (NaN, ±inf: the sampler's
    rules for those rows differ from ``max``) sends the whole pass to the sampler: ``(None, logits)``."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.packed = None
        if weight.device.type == "cpu" and available(weight.dtype):
            with torch.inference_mode():
                self.packed = pack_weight(weight)

    def describe(self) -> str:
        dt = str(self.weight.dtype).removeprefix("torch.")
        return f"{dt} logits ({'oneDNN-packed' if self.packed is not None else 'F.linear'}) + max"

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.to(self.weight.dtype)
        if self.packed is not None:
            return packed_matmul(h, self.packed)
        return F.linear(h, self.weight)

    def pick(self, hidden: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """hidden [B, d] → (token ids int64 [B], or None when a row's maximum is not finite; the logits [B, V])."""
        logits = self.logits(hidden)
        vals = logits.amax(dim=1)  # NaN propagates, as max's
        if not bool(torch.isfinite(vals).all()):
            return None, logits
        return first_max(logits, vals), logits


_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}  # same-width ints


def first_max(logits: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """``logits.max(dim=1).indices`` (the lowest index of each row's maximum) given the rows' finite maxima
    ``vals`` (``amax``). torch's ``max`` with indices runs unvectorised on bf16 (0.85–1.45 ms for 32 × 32k on the
    dev VM, against 0.2 ms for ``amax``): here the first position whose bit pattern equals the maximum's, found by
    numpy (an int16 compare and a bool ``argmax``, which stops at the first hit): 0.26 ms. Equal values have equal
    bits except ±0, so a pass with a zero maximum takes ``max``."""
    if (logits.dtype not in _BITS or logits.device.type != "cpu" or not logits.is_contiguous()
            or bool((vals == 0).any())):
        return logits.max(dim=1).indices
    bits = _BITS[logits.dtype]
    x = logits.view(bits).numpy()
    m = vals.contiguous().view(bits).numpy()
    return torch.from_numpy(np.argmax(x == m[:, None], axis=1).astype(np.int64, copy=False))
