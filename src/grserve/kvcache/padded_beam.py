"""Fixed-shape separated beam KV for the device fast path: the graph-capturable form of ``BeamKV`` (xGR §5.1).

A captured beam step needs every tensor at a fixed address and shape, whatever the batch. So the buffers are
sized for a *bucket* (R_b requests, shared length L_cap) and reused by every batch that fits it:

* ``shared_k/shared_v`` [layers, R_b, Hkv, L_cap, D]: request r's prompt KV in ``[..., r, :, :lens[r], :]``, the
  rest is padding that no kernel reads as a key (``lens`` [R_b] on the device; a padded request has length 0);
* ``unshared_k/unshared_v`` [layers, R_b·BW, ND, Hkv, D]: exactly BW × ND token slots per request, as ``BeamKV``;
* ``reorder(parents, upto)`` gathers the first ``upto`` slots of every layer's rows by parent through a
  preallocated one-layer workspace (fixed shapes, capturable).
"""

from __future__ import annotations

import torch


class PaddedBeamKV:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_requests: int, max_len: int,
                 beam_width: int, decode_steps: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.num_requests, self.max_len = num_requests, max_len
        self.beam_width, self.decode_steps = beam_width, decode_steps
        rows = num_requests * beam_width
        self.shared_k = torch.zeros(num_layers, num_requests, num_kv_heads, max_len, head_dim, dtype=dtype,
                                    device=device)
        self.shared_v = torch.zeros_like(self.shared_k)
        self.lens = torch.zeros(num_requests, dtype=torch.int64, device=device)
        self.key_bias = torch.zeros(num_requests, 1, 1, max_len, dtype=torch.float32, device=device)
        self.unshared_k = torch.zeros(num_layers, rows, decode_steps, num_kv_heads, head_dim, dtype=dtype,
                                      device=device)
        self.unshared_v = torch.zeros_like(self.unshared_k)
        # one contiguous one-layer workspace per reorder depth (a gather's ``out`` is then always contiguous)
        self._workspaces = [torch.empty(rows, u, num_kv_heads, head_dim, dtype=dtype, device=device)
                            for u in range(decode_steps + 1)]
        self._positions = torch.arange(max_len, device=device)
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * self.shared_k.element_size()

    def set_lengths(self, lens: list[int]) -> None:
        """Prompt lengths of this batch (requests beyond ``len(lens)`` are padding: length 0)."""
        full = lens + [0] * (self.num_requests - len(lens))
        self.lens.copy_(torch.tensor(full, dtype=torch.int64))
        valid = self._positions[None, :] < self.lens[:, None]
        self.key_bias.copy_(torch.where(valid, 0.0, float("-inf"))[:, None, None, :])

    def write_shared(self, layer: int, r: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """k/v [L_r − start, Hkv, D]: request r's prompt K/V of one layer from token ``start`` on (the tokens
        before came from the prefix cache)."""
        n = start + k.shape[0]
        self.shared_k[layer, r, :, start:n].copy_(k.transpose(0, 1))
        self.shared_v[layer, r, :, start:n].copy_(v.transpose(0, 1))

    def shared_request(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request slot r's shared K/V in every layer: [layers, Hkv, L_cap, D] views (the prefix cache's view)."""
        return self.shared_k[:, r], self.shared_v[:, r]

    def write_unshared(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.unshared_k[layer, :, slot].copy_(k)
        self.unshared_v[layer, :, slot].copy_(v)

    def unshared(self, layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.unshared_k[layer, :, :upto], self.unshared_v[layer, :, :upto]

    def reorder(self, parents: torch.Tensor, upto: int) -> None:
        """Row i of every layer's first ``upto`` unshared slots becomes old row ``parents[i]``."""
        ws = self._workspaces[upto]
        for buf in (self.unshared_k, self.unshared_v):
            for layer in range(buf.shape[0]):
                torch.index_select(buf[layer, :, :upto], 0, parents, out=ws)
                buf[layer, :, :upto].copy_(ws)

    def request_nbytes(self) -> int:
        """KV bytes one request slot of the bucket holds: (L_cap + BW·ND) · bytes per token."""
        return (self.max_len + self.beam_width * self.decode_steps) * self.bytes_per_token
