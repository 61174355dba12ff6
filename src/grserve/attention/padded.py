"""Staged beam attention over ``PaddedBeamKV`` (fixed shapes): the decode context of the device fast path.

``PaddedPrefillContext`` runs the packed prefill (eager; causal per request) and writes each prompt's K/V into its
padded shared slot. ``PaddedBeamDecodeContext`` is ``BeamDecodeContext`` with fixed shapes: the new K/V go to
unshared slot ``step``; the shared stage is one batched product over all requests with the padding keys masked
(``key_bias``), the unshared stage one call for all beams; the two partial states are merged by LSE
(``grserve.attention.staged.merge_states``) in fp32 and the result is rounded to the model dtype once. Which
kernels compute the stages is the ``backend`` (``grserve.attention.backends``).
"""

from __future__ import annotations

import torch

from grserve.attention import varlen
from grserve.attention.prefix_prefill import prefix_causal_attention
from grserve.attention.staged import merge_states
from grserve.kvcache.padded_beam import PaddedBeamKV


def shared_stage_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every beam of each request against its padded shared KV (the torch reference of the Triton kernel).

    q [R·BW, Hq, D] (request-major), k/v [R, Hkv, L_cap, D], key_bias [R, 1, 1, L_cap] (0 valid / −inf padding)
    → o [R·BW, Hq, D] (q's dtype), lse [R·BW, Hq] fp32 (fp64 for fp64 inputs). A request with no key gets o = 0, lse = −inf. Scores and
    softmax are at least fp32; the two products run in the input dtype."""
    rows, hq, d = q.shape
    r, hkv = k.shape[0], k.shape[1]
    bw, g = rows // r, hq // hkv
    qg = q.view(r, bw, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(r, hkv, bw * g, d)
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 softmax (fp64 stays fp64: the exact tests)
    s = torch.matmul(qg, k.transpose(-1, -2)).to(acc).mul_(d**-0.5).add_(key_bias)  # [R, Hkv, BW·G, L_cap]
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = s.sub_(lse.clamp_min(torch.finfo(acc).min)).exp_()  # an empty row: exp(−inf) = 0, not NaN
    o = torch.matmul(p.to(v.dtype), v)  # [R, Hkv, BW·G, D]
    o = o.view(r, hkv, bw, g, d).permute(0, 2, 1, 3, 4).reshape(rows, hq, d)
    lse = lse.view(r, hkv, bw, g).permute(0, 2, 1, 3).reshape(rows, hq)
    return o, lse


class PaddedPrefillContext:
    def __init__(self, kv: PaddedBeamKV, offsets: list[int], cached: list[int] | None = None, impl: str = "auto"):
        self.kv = kv
        self.offsets = offsets  # packed prompt r = tokens [offsets[r], offsets[r+1])
        self.cached = cached  # request r's first cached[r] tokens' K/V are in its shared slot (the prefix cache)
        self.impl = impl  # the packed causal attention (attention/varlen.py): auto | loop | flash

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for r in range(len(self.offsets) - 1):
            a, b = self.offsets[r], self.offsets[r + 1]
            self.kv.write_shared(layer, r, k[a:b], v[a:b], start=self.cached[r] if self.cached else 0)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._write(layer, k, v)
        if not self.cached:  # every prompt whole: one varlen call where the device has one, else one per prompt
            return varlen.packed_causal(q, k, v, self.offsets, self.impl)
        out = torch.empty_like(q)
        for r in range(len(self.offsets) - 1):
            a, b = self.offsets[r], self.offsets[r + 1]
            m = self.cached[r]
            if m:  # the rest of a prompt whose prefix came from the prefix cache: the same rule as the host path
                n = m + b - a
                out[a:b] = prefix_causal_attention(q[a:b], self.kv.shared_k[layer, r, :, :n],
                                                   self.kv.shared_v[layer, r, :, :n])
            else:
                out[a:b] = varlen.packed_causal_loop(q[a:b], k[a:b], v[a:b], [0, b - a])
        return out

    def attend_last(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The last layer of a prefill that keeps only each prompt's last row (``Decoder.forward(last_rows=)``):
        stores every row's K/V; q [S, Hq, D] holds the last query of each prompt, in order."""
        self._write(layer, k, v)
        keys = []
        for r in range(len(self.offsets) - 1):
            n = (self.cached[r] if self.cached else 0) + self.offsets[r + 1] - self.offsets[r]
            keys.append((self.kv.shared_k[layer, r, :, :n], self.kv.shared_v[layer, r, :, :n]))
        return varlen.last_token(q, keys)


class PaddedBeamDecodeContext:
    def __init__(self, kv: PaddedBeamKV, step: int, backend):
        self.kv, self.step, self.backend = kv, step, backend

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = self.kv
        kv.write_unshared(layer, self.step, k, v)
        uk, uv = kv.unshared(layer, self.step + 1)
        o_u, lse_u = self.backend.unshared_stage(q, uk, uv)
        o_s, lse_s = self.backend.shared_stage(q, kv.shared_k[layer], kv.shared_v[layer], kv)
        out, _ = merge_states(o_s.float(), lse_s.float(), o_u.float(), lse_u.float())
        return out.to(q.dtype)
