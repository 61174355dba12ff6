"""Attention backends of the device fast path: one decode step, several kernel sets (``--attention-backend``).

* ``torch``: plain torch ops, the reference, CPU and CUDA: ``shared_stage_padded`` (batched products, padding
  masked) and ``staged.unshared_stage``;
* ``triton``: grserve's Triton kernels (``grserve.kernels.beam_attention``), CUDA, or CPU under
  ``TRITON_INTERPRET=1``;
* ``flashinfer``: reserved for FlashInfer's cascade attention + ``merge_state`` (CUDA). Not wired in this build:
  selecting it raises a clear error (docs/gpu.md says why).

Every backend offers ``shared_stage(q, k, v, kv)`` (kv: the ``PaddedBeamKV``, for ``lens``/``key_bias``) and
``unshared_stage(q, k, v)``, each returning ``(o, lse)``. Imports of triton happen only when a Triton backend is
built, never on ``import grserve``.
"""

from __future__ import annotations

from grserve.attention.padded import shared_stage_padded
from grserve.attention.staged import unshared_stage


class TorchBackend:
    name = "torch"

    def shared_stage(self, q, k, v, kv):
        return shared_stage_padded(q, k, v, kv.key_bias)

    def unshared_stage(self, q, k, v):
        o, lse = unshared_stage(q, k, v)
        return o, lse.float()


class TritonBackend:
    name = "triton"

    def __init__(self, device: str = "cuda") -> None:
        from grserve.kernels import triton_available

        if not triton_available(device):
            raise RuntimeError("attention backend 'triton' needs the triton package and a CUDA device "
                               "(or TRITON_INTERPRET=1 on CPU)")
        from grserve.kernels.beam_attention import shared_stage_triton, unshared_stage_triton

        self._shared, self._unshared = shared_stage_triton, unshared_stage_triton

    def shared_stage(self, q, k, v, kv):
        return self._shared(q, k, v, kv.lens)

    def unshared_stage(self, q, k, v):
        return self._unshared(q, k, v)


def get_backend(name: str, device: str = "cuda"):
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        return TritonBackend(device)
    if name == "flashinfer":
        raise RuntimeError("attention backend 'flashinfer' is not wired in this build (see docs/gpu.md); "
                           "use torch or triton")
    raise ValueError(f"unknown attention backend {name!r}")

