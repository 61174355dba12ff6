"""Separated beam KV cache (xGR §5.1): one ``shared_kv`` per request, token-granular ``unshared_kv`` per beam.

For a batch of R requests with prompt lengths L_r, beam width BW and ND decode steps:

* ``shared_k/shared_v`` [layers, Hkv, ΣL_r, D]: each prompt's KV stored once, head-major, packed by request.
* ``unshared_k/unshared_v`` [layers, R·BW, ND, Hkv, D]: exactly BW × ND token slots per request per layer.

So a request holds exactly ``(L_r + BW·ND) · bytes_per_token`` of KV (``bytes_per_token`` = 2·layers·Hkv·D·
element size). After every beam-selection step the unshared rows are reordered by parent index. The default
reorder gathers through one preallocated layer-sized workspace owned by the batch (not per request), so it is
correct for *any* parent vector. The paper's two-pass direction-index scheme needs no workspace at all but is
only correct when parents are non-decreasing; tests/grserve/kvcache/test_beam_kv.py holds it and proves the precondition (see
docs/decisions.md).
"""

from __future__ import annotations

import torch


class BeamKV:
    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        prompt_lens: list[int],
        beam_width: int,
        decode_steps: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.prompt_lens = list(prompt_lens)
        self.beam_width = beam_width
        self.decode_steps = decode_steps
        self.num_requests = len(prompt_lens)
        starts = [0]
        for n in prompt_lens:
            starts.append(starts[-1] + n)
        self.offsets = starts
        total = starts[-1]
        rows = self.num_requests * beam_width
        self.shared_k = torch.empty(num_layers, num_kv_heads, total, head_dim, dtype=dtype, device=device)
        self.shared_v = torch.empty_like(self.shared_k)
        self.unshared_k = torch.empty(num_layers, rows, decode_steps, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.unshared_v = torch.empty_like(self.unshared_k)
        self._workspace = torch.empty_like(self.unshared_k[0])  # one layer, reused for every reorder
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * self.shared_k.element_size()

    # ---- shared_kv -----------------------------------------------------------------------------------------
    def write_shared(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [ΣL, Hkv, D]: the packed prefill of every request in the batch."""
        self.shared_k[layer].copy_(k.transpose(0, 1))
        self.shared_v[layer].copy_(v.transpose(0, 1))

    def write_shared_request(self, layer: int, r: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """k/v [L_r − start, Hkv, D]: request ``r``'s prompt alone, from token ``start`` on (the tokens before came
        from the prefix cache)."""
        a, b = self.offsets[r] + start, self.offsets[r + 1]
        self.shared_k[layer, :, a:b].copy_(k.transpose(0, 1))
        self.shared_v[layer, :, a:b].copy_(v.transpose(0, 1))

    def shared(self, layer: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.offsets[r], self.offsets[r + 1]
        return self.shared_k[layer, :, a:b], self.shared_v[layer, :, a:b]

    def shared_request(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request ``r``'s ``shared_kv`` in every layer: [layers, Hkv, L_r, D] views (the prefix cache's view)."""
        a, b = self.offsets[r], self.offsets[r + 1]
        return self.shared_k[:, :, a:b], self.shared_v[:, :, a:b]

    # ---- unshared_kv ---------------------------------------------------------------------------------------
    def write_unshared(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [R·BW, Hkv, D]: the new token of every beam goes to ``slot`` (0-based decode step)."""
        self.unshared_k[layer, :, slot].copy_(k)
        self.unshared_v[layer, :, slot].copy_(v)

    def unshared(self, layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.unshared_k[layer, :, :upto], self.unshared_v[layer, :, :upto]

    def reorder(self, parents: torch.Tensor) -> None:
        """Row i of every layer's unshared cache becomes old row ``parents[i]`` (flat over the batch)."""
        ws = self._workspace
        for buf in (self.unshared_k, self.unshared_v):
            for layer in range(buf.shape[0]):
                torch.index_select(buf[layer], 0, parents, out=ws)
                buf[layer].copy_(ws)

    # ---- accounting ----------------------------------------------------------------------------------------
    def request_nbytes(self, r: int) -> int:
        return (self.prompt_lens[r] + self.beam_width * self.decode_steps) * self.bytes_per_token

    def nbytes(self) -> int:
        """KV bytes held for the batch (shared + unshared; the transient reorder workspace is not KV)."""
        tensors = (self.shared_k, self.shared_v, self.unshared_k, self.unshared_v)
        return sum(t.numel() * t.element_size() for t in tensors)
