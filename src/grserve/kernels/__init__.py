"""Triton kernels of the device fast path (issue 15), each with a torch reference it is tested against.

Nothing here is imported by ``import grserve``: ``triton`` is imported inside the functions that launch a kernel,
so grserve runs without it. On CPU the kernels run only under ``TRITON_INTERPRET=1`` (set before the first
``@triton.jit`` is executed; the tests do it in ``tests/conftest.py`` when CUDA is absent).

* ``beam_attention.unshared_stage_triton``: each beam's query against its own decoded tokens, with the LSE
  (reference: ``grserve.attention.staged.unshared_stage``);
* ``beam_attention.shared_stage_triton``: every beam of a request against its padded shared prompt KV, with the
  LSE (reference: ``grserve.attention.padded.shared_stage_padded``);
* ``masked_topk.masked_topk_expand_triton``: trie mask + log-softmax over a beam's valid children + per-beam
  top-K + the beam's score added (reference: ``grserve.search.masked_topk.masked_topk_expand``).
"""


def triton_available(device: str = "cuda") -> bool:
    """True when ``import triton`` works and a kernel can run on ``device``'s tensors: a CUDA device needs CUDA,
    CPU tensors need the interpreter (``TRITON_INTERPRET=1``)."""
    import os

    try:
        import triton  # noqa: F401
    except Exception:
        return False
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.is_available()
    return os.environ.get("TRITON_INTERPRET") == "1"
