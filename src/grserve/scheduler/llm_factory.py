"""The LLM scheduling policies by name (config): ``make_llm_scheduler("aptserve", ...)``.

Importing this module registers every policy in ``llm_types.LLM_SCHEDULERS``: fcfs | chunked | aptserve |
aptserve-kv (Apt-Serve's scheduling with the KV cache only: the paper's "Apt-Serve KV-only" ablation).
"""

from __future__ import annotations

from grserve.scheduler import aptserve, chunked, fcfs  # noqa: F401 - each module registers its policy
from grserve.scheduler.llm_types import LLM_SCHEDULERS, LLMScheduler

SCHEDULERS = LLM_SCHEDULERS.names()  # the names, e.g. for a command line's choices


def make_llm_scheduler(name: str, **kw) -> LLMScheduler:
    """Build a policy by name (config); ``kw`` go to its constructor."""
    return LLM_SCHEDULERS.create(name, **kw)
