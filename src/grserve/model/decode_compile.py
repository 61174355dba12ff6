"""``--decode-compile``: a pure decode step's whole layer stack as one ``torch.compile``d (Inductor) graph per row bucket.

A decode step of a small model is bound by per-op overhead, not arithmetic: the tiny preset (4 layers, hidden 256)
runs ~35 eager ops per layer (RMSNorms, q/k-norm, RoPE, SiLU·mul, residual adds, seven projections) for a few µs of
math each. ``CompiledDecode`` traces ``Decoder.forward``'s arithmetic for a pure decode pass (every request one new
token, K/V cache only) once per bucket of rows and lets Inductor fuse the elementwise work into a few C++ kernels:

    embedding → per layer: RMSNorm → q/k/v → q/k-norm → RoPE → [attention] → o_proj + residual → RMSNorm →
    gate/up → SiLU·mul → down + residual → final RMSNorm                        (one compiled graph)

Two ops stay opaque inside the graph (``torch.library`` custom ops, so Inductor calls them and fuses around them):

* ``grserve::decode_attend(q, k, v, layer)`` runs the pass's ``HybridPagedContext.attend`` (it writes the K/V
  cache and the staging buffer and knows the requests) on the first ``n`` rows only: the padding rows of a bucket
  are never attended to and never written anywhere (their output is zeros);
* ``grserve::packed_linear(x, key)`` runs the projection as the eager path does (the executor's oneDNN-packed
  weight, ``torch.ops.mkldnn._linear_pointwise``; ``F.linear`` where nothing is packed), so the GEMMs, and their
  accumulation order, are the eager path's. q/k/v and gate/up run as one GEMM each over the concatenated packed
  weights where a trial at construction finds the fused output bit-identical to the separate ones
  (``fusion_agrees``: so on the tiny preset in fp32 and bf16), else separately.

RoPE's cos/sin come from a table of ``Decoder.rope`` over every position (looked up in the graph: the same values,
``Decoder.rope`` is per position). In bf16 Inductor's ``emulate_precision_casts`` rounds every intermediate to bf16
where eager does, so the compiled step gives the eager step's tokens (tests: identical greedy ids in bf16 and fp32,
and the tiny preset's bf16 step bit-identical to eager).

Shapes are static per bucket (``BUCKETS``: 1, 2, 4, 8, 16, 32, 64 rows, the padding rows token 0 at position 0; a
larger batch runs eager). The small buckets are for latency: one request padded to 8 rows paid 8 rows' GEMMs and
kernels, ~13 % of its step (docs/llm.md). ``warm_up`` (called by ``AsyncLLMEngine.build``, so at ``serve llm``
start-up) compiles the buckets smallest first within a budget (60 s); the ones that do not fit compile on a
background thread while their steps run eager. Inductor's FX graph cache, under
``$GRSERVE_CACHE_DIR/inductor/<lane>`` (``cache_dir``; an explicit ``TORCHINDUCTOR_CACHE_DIR`` wins), makes a
restart's compile mostly a cache load (tiny preset bf16, 2 cores: the seven buckets 88 s cold, of which buckets 1, 2
and 4 fit the budget; 5 s from the cache; docs/llm.md).
Any failure (no C++ compiler, an Inductor error) falls back to ``Decoder.forward`` for good, with one warning.
Every other pass (prefill, mixed, hidden cache) is eager.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from grserve.model.decoder import Decoder, _rotate, rms_norm
from grserve.model.packed_linear import pack_weight, packed_matmul

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # decode rows padded up to one of these (more rows: the eager step)


def cache_dir() -> Path:
    """Where Inductor keeps its compiled graphs across restarts: ``$GRSERVE_CACHE_DIR/inductor/<lane>`` (else
    ``.grserve-cache/inductor/<lane>``), unless ``TORCHINDUCTOR_CACHE_DIR`` is set. ``<lane>``: the torch version and
    the CPU capability torch and oneDNN run at (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, ``GRSERVE_CPU_ISA``):
    Inductor's own keys do not tell an AVX2-forced process from a native one, and a graph cached natively gave wrong
    tokens when loaded under the AVX2 lane (found by the tests; not root-caused), so each lane has its own cache."""
    cap = torch.backends.cpu.get_cpu_capability()
    lane = "-".join([torch.__version__.replace("+", "_"), cap, os.environ.get("ONEDNN_MAX_CPU_ISA") or "native",
                     os.environ.get("GRSERVE_CPU_ISA") or "native"]).lower()
    return Path(os.environ.get("GRSERVE_CACHE_DIR") or ".grserve-cache") / "inductor" / lane


def use_cache_dir() -> str:
    """Point Inductor's on-disk caches at ``cache_dir()`` (before the first compile; an explicit
    ``TORCHINDUCTOR_CACHE_DIR`` wins)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # Inductor writes its own default into the environment on first use: only a different value was chosen
    if not path or os.path.abspath(path) == os.path.abspath(default_cache_dir()):
        path = str(cache_dir().resolve())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


# ---- the two opaque ops ---------------------------------------------------------------------------------------
# the running pass's attention context (.ctx), its real row count (.n) and its model's projections (.table: key ->
# (packed weight or None, weight, bias)); the keys are positions in .table, so the same model shape gives the same
# graph in every process (Inductor's on-disk cache hits); .configured: this thread ran _compile_settings
_state = threading.local()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The running pass's ``ctx.attend(layer, …)`` on its ``n`` real rows; padding rows → zeros."""
    ctx, n = _state.ctx, _state.n
    o = ctx.attend(layer, q[:n], k[:n], v[:n])
    if n < q.shape[0]:
        o = F.pad(o, (0, 0, 0, 0, 0, q.shape[0] - n))
    return o.contiguous()


def _linear(x: torch.Tensor, key: int) -> torch.Tensor:
    """The eager path's projection: the oneDNN-packed weight where the executor packed it, else ``F.linear``."""
    packed, w, b = _state.table[key]
    if packed is None:
        return F.linear(x, w, b)
    return packed_matmul(x, packed, b)


def _register() -> None:
    """The ops as plain ``torch.library`` kernels (the dispatcher calls the Python function directly: less per-call
    work than ``torch.library.custom_op``'s wrappers, ~30 calls a step), with shape-only fake kernels."""
    try:
        torch.ops.grserve.decode_attend  # noqa: B018 -- registered already (a re-import)
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("grserve", "FRAGMENT")
    lib.define("decode_attend(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")
    lib.define("packed_linear(Tensor x, int key) -> Tensor")
    lib.impl("decode_attend", _attend, "CompositeExplicitAutograd")
    lib.impl("packed_linear", _linear, "CompositeExplicitAutograd")
    torch.library.register_fake("grserve::decode_attend", lambda q, k, v, layer: torch.empty_like(q), lib=lib)
    torch.library.register_fake("grserve::packed_linear",
                                lambda x, key: x.new_empty((x.shape[0], _state.table[key][1].shape[0])), lib=lib)
    _LIBS.append(lib)


_LIBS: list = []  # keeps the registrations alive
_register()


class _WarmContext:
    """A stand-in attention context for compiling a bucket at start-up: attends to nothing, writes nothing."""

    def attend(self, layer, q, k, v):
        return torch.zeros_like(q)


# ---- the compiled stack -------------------------------------------------------------------------------------

class _Stack(torch.nn.Module):
    """``Decoder.forward``'s arithmetic for B decode rows (no groups, no last_rows, no hidden cache). ``keys``: per
    layer, the ``packed_linear`` keys of its projection groups (q/k/v, o, gate/up, down), each a tuple of
    ``(key, output sizes)``: one key with several sizes is a fused GEMM whose output is split."""

    def __init__(self, model: Decoder, keys: list[list[list[tuple[int, tuple[int, ...]]]]]):
        super().__init__()
        self.model = model
        self.keys = keys

    @staticmethod
    def _proj(h: torch.Tensor, group) -> list[torch.Tensor]:
        out = []
        for key, sizes in group:
            y = torch.ops.grserve.packed_linear(h, key)
            out.extend(y.split(sizes, dim=-1) if len(sizes) > 1 else (y,))
        return out

    def forward(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        m = self.model
        eps = m.spec.rms_norm_eps
        x = F.embedding(ids, m.model.embed_tokens.weight)
        n = x.shape[0]
        for i, layer in enumerate(m.model.layers):
            qkv, o_grp, gu, down = self.keys[i]
            a = layer.self_attn
            h = rms_norm(x, layer.input_layernorm.weight, eps)
            q, k, v = self._proj(h, qkv)
            q, k, v = q.reshape(n, a.hq, a.d), k.reshape(n, a.hkv, a.d), v.reshape(n, a.hkv, a.d)
            if a.q_norm is not None:
                q, k = rms_norm(q, a.q_norm.weight, eps), rms_norm(k, a.k_norm.weight, eps)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            o = torch.ops.grserve.decode_attend(q, k, v, i)
            x = x + self._proj(o.reshape(n, a.hq * a.d), o_grp)[0]
            h = rms_norm(x, layer.post_attention_layernorm.weight, eps)
            g, u = self._proj(h, gu)
            x = x + self._proj(F.silu(g) * u, down)[0]
        return rms_norm(x, m.model.norm.weight, eps)


def bucket_of(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket ≥ n (None: more rows than the largest bucket)."""
    return next((b for b in sizes if b >= n), None)


def fusion_agrees(lins, packed_weights: dict, sizes=(1, 2, 8, 32, 64), seed: int = 0) -> bool:
    """Whether one oneDNN GEMM over the concatenated packed weights of ``lins`` gives, bit for bit, the separate
    GEMMs' outputs side by side (the eager path runs them separately), for a few row counts. Checked per model
    at construction: it holds for the tiny preset's shapes in fp32 and bf16 (the K blocking does not depend on N
    there), but nothing promises it for every shape."""
    if any(lin not in packed_weights for lin in lins):
        return False
    w = lins[0].weight
    fused = _fused_packed(lins)
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for m in sizes:
            x = torch.randn(m, w.shape[1], generator=g).to(w.dtype)
            sep = torch.cat([packed_matmul(x, packed_weights[lin], lin.bias) for lin in lins], dim=-1)
            got = packed_matmul(x, fused[0], fused[2])
            if not torch.equal(sep, got):
                return False
    return True


def _fused_packed(lins) -> tuple:
    """(packed weight, weight, bias) of ``lins`` concatenated along the output dimension."""
    with torch.inference_mode():
        w = torch.cat([lin.weight.detach() for lin in lins])
        bias = None if lins[0].bias is None else torch.cat([lin.bias.detach() for lin in lins])
        return pack_weight(w), w, bias


def _compile_settings() -> None:
    """Dynamo's and Inductor's settings for compiling the buckets, once per thread: torch 2.13 keeps these configs
    per thread (a value set on one thread is the default on another), and any thread that runs the compiled stack
    (start-up, the background compile thread, the step loop: a recompile can happen on any) may compile, so
    ``_run`` calls this on each before its first call."""
    if getattr(_state, "configured", False):
        return
    _state.configured = True
    import torch._dynamo
    import torch._inductor.config as inductor_config

    # one graph per bucket, all on the same code: room for every bucket (dynamo's default limit is 8)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 256)
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        # C++ kernels compiled in this process: on a small machine the worker pool's start-up costs more than its
        # parallel g++ runs save (measured, docs/llm.md)
        inductor_config.compile_threads = 1


class CompiledDecode:
    """``decode.forward(ids, positions, ctx)`` = ``model(ids, positions, ctx, packed=packed)`` for a pure decode
    pass, the layer stack compiled per row bucket. ``failed``: why compiling failed (then: the eager forward for
    good). ``fuse``: q/k/v and gate/up as one GEMM each where ``fusion_agrees`` (the same bits as the separate ones)."""

    def __init__(self, model: Decoder, packed=None, bucket_sizes: tuple[int, ...] = BUCKETS, compile_fn=None,
                 fuse: bool = True):
        if getattr(model, "quantized", None) is not None:
            raise ValueError("a quantized model's decode step is not compiled")
        self.model, self.packed = model, packed
        self.bucket_sizes = tuple(sorted(bucket_sizes))
        self.max_bucket = self.bucket_sizes[-1]
        weights = getattr(packed, "weights", {}) if packed is not None else {}
        layer0 = model.model.layers[0]
        fuse_qkv = fuse and fusion_agrees([layer0.self_attn.q_proj, layer0.self_attn.k_proj,
                                           layer0.self_attn.v_proj], weights, self.bucket_sizes)
        fuse_gu = fuse and fusion_agrees([layer0.mlp.gate_proj, layer0.mlp.up_proj], weights, self.bucket_sizes)
        self.fused = [name for name, ok in (("q/k/v", fuse_qkv), ("gate/up", fuse_gu)) if ok]
        keys = []
        self._table: list[tuple] = []  # packed_linear's key -> (packed weight or None, weight, bias)

        def group(lins, fused: bool):
            if fused:
                self._table.append(_fused_packed(lins))
                return [(len(self._table) - 1, tuple(lin.weight.shape[0] for lin in lins))]
            out = []
            for lin in lins:
                self._table.append((weights.get(lin), lin.weight, lin.bias))
                out.append((len(self._table) - 1, (lin.weight.shape[0],)))
            return out

        for layer in model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            keys.append([group([a.q_proj, a.k_proj, a.v_proj], fuse_qkv), group([a.o_proj], False),
                         group([mlp.gate_proj, mlp.up_proj], fuse_gu), group([mlp.down_proj], False)])
        self.stack = _Stack(model, keys)
        self.cache_dir = use_cache_dir()
        import torch._inductor.config as inductor_config

        options = {"emulate_precision_casts": True} if hasattr(inductor_config, "emulate_precision_casts") else {}
        self._compiled = (compile_fn or (lambda f: torch.compile(f, dynamic=False, options=options)))(self.stack)
        self._cos = self._sin = None  # RoPE tables (model dtype) over positions 0 … len-1
        self.failed: str | None = None
        self.compiled_buckets: set[int] = set()  # buckets run through the compiled graph at least once
        self.compile_s = 0.0  # time spent in first calls of a bucket (tracing + Inductor, or a cache load)
        self.steps = 0  # decode passes served compiled
        self.warm_s: float | None = None  # warm_up's seconds
        self.bucket_s: dict[int, float] = {}  # warm_up's seconds per bucket
        self.deferred = ""  # the buckets warm_up left to later, if any
        self.pending: set[int] = set()  # buckets compiling on the background thread (their steps run eager)
        self.on_background_done = None  # called with one line when the background thread has compiled its buckets

    # ---- what runs compiled
    def accepts(self, ctx, n: int) -> bool:
        """A pure-KV decode pass (every request one new token, K/V cache only) of at most ``max_bucket`` rows."""
        return (self.failed is None and n <= self.max_bucket and getattr(ctx, "pure_decode", False)
                and getattr(ctx, "all_kv", False) and not getattr(ctx, "lone_prefill", True)
                and bucket_of(n, self.bucket_sizes) not in self.pending)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top = int(positions.max()) + 1
        if self._cos is None or self._cos.shape[0] < top:
            size = max(top, 2 * (self._cos.shape[0] if self._cos is not None else 1024))
            size = min(max(size, top), max(top, self.model.spec.max_position_embeddings))
            self._cos, self._sin = self.model.rope(torch.arange(size, device=positions.device))
        return self._cos, self._sin

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        if self.failed is None:
            try:
                h = self._run(ids, positions, ctx)
                self.steps += 1
                return h
            except Exception as exc:  # noqa: BLE001 -- any compile/runtime failure: the eager forward
                self.fail(exc)
        return self.model(ids, positions, ctx, packed=self.packed)

    __call__ = forward

    def fail(self, exc: BaseException) -> None:
        self.failed = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        warnings.warn(f"compiled decode step failed, using the eager decode step: {self.failed}", RuntimeWarning,
                      stacklevel=3)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        n = ids.shape[0]
        b = bucket_of(n, self.bucket_sizes)
        if b > n:  # padding rows: token 0 at position 0, never attended to (decode_attend), never read
            ids = F.pad(ids, (0, b - n))
            positions = F.pad(positions, (0, b - n))
        cos_t, sin_t = self._rope(positions)
        cos, sin = cos_t.index_select(0, positions), sin_t.index_select(0, positions)
        _state.ctx, _state.n, _state.table = ctx, n, self._table
        first = b not in self.compiled_buckets
        _compile_settings()  # this thread may compile (once per thread)
        t0 = time.perf_counter()
        try:
            h = self._compiled(ids, cos, sin)
        finally:
            _state.ctx = _state.table = None
        if first:
            self.compile_s += time.perf_counter() - t0
            self.compiled_buckets.add(b)
        return h[:n] if b > n else h

    # ---- start-up
    def warm_up(self, bucket_list: tuple[int, ...] | None = None, budget_s: float = 60.0, log=None,
                background: bool = True) -> float:
        """Compile ``bucket_list`` (default: every bucket) now, smallest first, on a stand-in context (no cache, no
        K/V). A bucket is not started here when the time spent plus twice the previous bucket's would pass ``budget_s``:
        it and the larger ones compile on a background thread (``background``; their steps run eager until each is
        ready, so no step waits for a compile) or else on their first step. Returns the seconds spent here; a
        failure disables the compiled step (``failed``)."""
        t0 = time.perf_counter()
        last = 0.0  # the previous bucket's seconds (the next one: up to about twice that, measured cold)
        todo = [b for b in sorted(bucket_list or self.bucket_sizes)
                if b in self.bucket_sizes and b not in self.compiled_buckets]
        for i, b in enumerate(todo):
            if self.failed is not None:
                break
            if time.perf_counter() - t0 + 2 * last > budget_s:  # a larger bucket may take longer
                rest = todo[i:]
                where = "a background thread (eager until ready)" if background else "their first step"
                self.deferred = (f"buckets {','.join(map(str, rest))} compile on {where}: warm-up budget "
                                 f"{budget_s:.0f} s")
                if log is not None:
                    log(f"decode compile: {self.deferred}")
                if background:
                    self.pending = set(rest)
                    threading.Thread(target=self._compile_later, args=(rest,), name="grserve-decode-compile",
                                     daemon=True).start()
                break
            last = self._compile_bucket(b)
        self.warm_s = time.perf_counter() - t0
        return self.warm_s

    def _compile_bucket(self, b: int) -> float:
        t1 = time.perf_counter()
        try:
            with torch.inference_mode():  # as the executor's step: inference tensors (dynamo guards on it)
                ids = torch.zeros(b, dtype=torch.int64, device=self.model.device)
                self._run(ids, torch.arange(b, device=ids.device), _WarmContext())
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
        self.bucket_s[b] = time.perf_counter() - t1
        return self.bucket_s[b]

    def _compile_later(self, buckets: list[int]) -> None:
        t0 = time.perf_counter()
        for b in buckets:
            if self.failed is None:
                self._compile_bucket(b)
            self.pending.discard(b)
        if self.on_background_done is not None:
            state = f"failed ({self.failed})" if self.failed is not None else "compiled"
            self.on_background_done(f"decode compile: buckets {','.join(map(str, buckets))} {state} on the "
                                    f"background thread in {time.perf_counter() - t0:.1f} s")

    def describe(self) -> str:
        if self.failed is not None:
            return f"decode step eager (compile failed: {self.failed})"
        fused = f", fused {' and '.join(self.fused)} GEMMs" if self.fused else ""
        done = sorted(self.compiled_buckets)
        warm = (f"; buckets {','.join(map(str, done))} compiled in {self.warm_s:.1f} s at start-up"
                if done and self.warm_s is not None else "")
        later = f"; {self.deferred}" if self.deferred else ""
        return (f"decode step compiled (Inductor, row buckets {','.join(map(str, self.bucket_sizes))}{fused}{warm}"
                f"{later}; cache {self.cache_dir})")


MODES = ("auto", "on", "off")


def compiler_missing() -> str | None:
    """Why Inductor's CPU backend cannot build here (no C++ compiler), else None."""
    from grserve.attention.decode_kernel import compiler

    return None if compiler() else "no C++ compiler on PATH"


def decode_compiler(model: Decoder, packed, mode: str = "off") -> CompiledDecode | None:
    """``--decode-compile``: ``off`` → None (eager); ``on`` → a ``CompiledDecode`` (a quantized model stays
    eager); ``auto`` → one on a CPU where the fast paths are on (not ``GRSERVE_CPU_ISA=reference``) and a C++
    compiler exists, else None."""
    if mode not in MODES:
        raise ValueError(f"decode_compile must be one of {MODES}, not {mode!r}")
    if mode == "off" or getattr(model, "quantized", None) is not None:
        return None
    if mode == "auto":
        from grserve.model.cpu_support import cpu_support

        if model.device.type != "cpu" or not cpu_support().fast_paths or compiler_missing():
            return None
    return CompiledDecode(model, packed)
