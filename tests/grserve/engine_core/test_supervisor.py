"""The supervisor's next incarnation runs as the first one did: the torch thread count measured at the first start
is kept (issue 41: at fp32 a few kernels sum in another order with another thread count, so a count measured anew
after a crash could move scores in their last bits)."""

from __future__ import annotations

from grserve.config import LLMConfig, LLMServeConfig, ProcessConfig, RankingServeConfig, ServeConfig
from grserve.engine_core.supervisor import CoreSupervisor


def test_a_measured_thread_count_is_kept_for_the_next_incarnation():
    for kind, cfg, part in (("retrieval", ServeConfig(), "process"), ("ranking", RankingServeConfig(), "process"),
                            ("llm", LLMServeConfig(), "llm")):
        sup = CoreSupervisor(kind, cfg)
        assert getattr(sup.config, part).threads == 0
        sup.started({"threads": 2})
        assert sup.ready and getattr(sup.config, part).threads == 2, kind
        assert sup._kept() == ", 2 torch threads as before"
        assert cfg.process.threads == 0  # the caller's config is not changed


def test_a_thread_count_the_user_gave_stays_and_no_count_changes_nothing():
    cfg = ServeConfig(process=ProcessConfig(threads=1))
    sup = CoreSupervisor("retrieval", cfg)
    sup.started({"threads": 2})
    assert sup.config.process.threads == 1
    llm = LLMServeConfig(llm=LLMConfig(threads=3))
    sup = CoreSupervisor("llm", llm)
    sup.started({"threads": 1})
    assert sup.config.llm.threads == 3
    sup = CoreSupervisor("retrieval", ServeConfig())
    sup.started({})  # a core that reports no count: the config as given
    assert sup.config.process.threads == 0 and sup._kept() == ""
