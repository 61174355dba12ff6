"""The prefill's attention over packed prompts of different lengths, and the last-token attention of its last layer.

``packed_causal`` is the causal attention of a packed prefill: prompt r is rows ``[cu[r], cu[r+1])`` of q/k/v
[N, H, D] and sees only its own keys. Two implementations, one contract:

* ``loop``: one fused causal SDPA call per prompt (the reference; the CPU path, where it is the fastest
  measured, docs/gpu.md "The prefill"). On CUDA the KV heads are repeated so that the flash kernel applies.
* ``flash``: one FlashAttention varlen call for all prompts (``torch.nn.attention.varlen.varlen_attn``, CUDA,
  fp16/bf16 only: fp32 keeps the loop): no per-prompt launches, no host loop. Its signature changed between torch releases (``is_causal`` in
  the first ones, ``window_size=(-1, 0)`` later); both are handled. If the call fails (an older torch, a GPU
  the kernel does not support, a dtype it refuses) the context falls back to ``loop`` for good and says why once.

``last_token`` is what the prefill's last layer needs when only each prompt's last hidden state is read (the LM
head): each prompt's last query against all of its keys (the causal row of the last token is the whole prompt).
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn.functional as F

IMPLS = ("auto", "loop", "flash")
_flash_failed: str | None = None  # why the varlen flash call failed in this process (then: loop for good)


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


FLASH_DTYPES = (torch.float16, torch.bfloat16)  # FlashAttention has no fp32 kernel: fp32 takes the loop


def flash_available(device: torch.device, dtype: torch.dtype) -> bool:
    """The varlen flash call can be tried here: a CUDA device, fp16/bf16, a torch that has it, no failure yet."""
    return (device.type == "cuda" and dtype in FLASH_DTYPES and _flash_failed is None
            and _varlen_fn() is not None)


def flash_failure() -> str | None:
    """Why the varlen flash call failed in this process (it then runs the loop), or None."""
    return _flash_failed


def resolve(impl: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` / ``flash`` → ``flash`` where ``flash_available``, else ``loop``; ``loop`` stays."""
    if impl not in IMPLS:
        raise ValueError(f"packed attention impl {impl!r}: expected one of {', '.join(IMPLS)}")
    return "flash" if impl != "loop" and flash_available(device, dtype) else "loop"


def packed_causal_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """The reference: q [N, Hq, D], k/v [N, Hkv, D], prompt r = rows [cu[r], cu[r+1]) → o [N, Hq, D]."""
    out = torch.empty_like(q)
    for r in range(len(cu) - 1):
        a, b = cu[r], cu[r + 1]
        if a == b:
            continue
        qr, kr, vr = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if q.device.type == "cuda" and kr.shape[1] != qr.shape[1]:
            # repeat the KV heads: CUDA's flash kernel then applies for sure (enable_gqa may fall back to
            # the math kernel, which materialises [Hq, L, L] scores: 1.6 GB per 5000-token prompt and layer)
            g = qr.shape[1] // kr.shape[1]
            kr, vr = kr.repeat_interleave(g, dim=1), vr.repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=kr.shape[1] != qr.shape[1])
        out[a:b] = o[0].transpose(0, 1)
    return out


def packed_causal_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int
                        ) -> torch.Tensor:
    """One FlashAttention varlen call (CUDA): cu int32 [S+1] on q's device, max_len the longest prompt."""
    fn = _varlen_fn()
    params = inspect.signature(fn).parameters
    kw: dict = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return fn(q, k, v, cu, cu, max_len, max_len, **kw)


def packed_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], impl: str = "auto"
                  ) -> torch.Tensor:
    """Causal attention of packed prompts (the module docstring); ``impl``: auto | loop | flash."""
    global _flash_failed
    if resolve(impl, q.device, q.dtype) == "flash":
        try:
            cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
            lens = [b - a for a, b in zip(cu, cu[1:])]
            return packed_causal_flash(q, k, v, cu_t, max(lens))
        except Exception as exc:  # noqa: BLE001 -- any failure: the loop, which runs everywhere
            _flash_failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if str(exc) else type(exc).__name__
            warnings.warn(f"varlen flash attention failed, the prefill uses one SDPA call per prompt: {_flash_failed}",
                          RuntimeWarning, stacklevel=2)
    return packed_causal_loop(q, k, v, cu)


def last_token(q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """q [S, Hq, D]: prompt s's last query; keys[s] = (k, v) [Hkv, L_s, D] head-major, all of prompt s's K/V
    (cached prefix included) → o [S, Hq, D]. Non-causal: the last token sees every key of its prompt."""
    out = torch.empty_like(q)
    for s, (k, v) in enumerate(keys):
        qs = q[s].unsqueeze(0).transpose(0, 1).unsqueeze(0)  # [1, Hq, 1, D]
        kr, vr = k.unsqueeze(0), v.unsqueeze(0)
        if q.device.type == "cuda" and kr.shape[1] != qs.shape[1]:
            g = qs.shape[1] // kr.shape[1]
            kr, vr = kr.repeat_interleave(g, dim=1), vr.repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(qs, kr, vr, enable_gqa=kr.shape[1] != qs.shape[1])
        out[s] = o[0, :, 0]
    return out
