"""The LLM scheduling policies by name (config): ``make_llm_scheduler("aptserve", ...)``."""

from __future__ import annotations

from grserve.scheduler.llm_types import LLMScheduler

SCHEDULERS = ("fcfs", "chunked", "aptserve", "aptserve-kv")


def make_llm_scheduler(name: str, **kw) -> LLMScheduler:
    """Build a policy by name (config): fcfs | chunked | aptserve | aptserve-kv (Apt-Serve's scheduling with the
    KV cache only: the paper's "Apt-Serve KV-only" ablation); ``kw`` go to its constructor."""
    if name == "fcfs":
        from grserve.scheduler.fcfs import FCFSScheduler
        return FCFSScheduler(**kw)
    if name == "chunked":
        from grserve.scheduler.chunked import ChunkedPrefillScheduler
        return ChunkedPrefillScheduler(**kw)
    if name in ("aptserve", "aptserve-kv"):
        from grserve.scheduler.aptserve import AptServeScheduler
        if name == "aptserve-kv":
            kw = {**kw, "hybrid": False}
        return AptServeScheduler(**kw)
    raise ValueError(f"unknown scheduler {name!r}; choose from {', '.join(SCHEDULERS)}")
