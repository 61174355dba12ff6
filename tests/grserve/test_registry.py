"""The by-name registry (grserve.registry) and the config choices that must name exactly what is registered."""

import subprocess
import sys

import pytest

from grserve import config
from grserve_bench.llm_workloads import DATASETS, LENGTH_DISTRIBUTIONS
from grserve.eviction import EVICTION_POLICIES
from grserve.kvcache.prefix_kv import PrefixKVStore
from grserve.registry import Registry, UnknownName
from grserve.scheduler.llm_factory import SCHEDULERS, make_llm_scheduler
from grserve.scheduler.llm_types import LLM_SCHEDULERS
from grserve.scheduler.prefix_choice import PREFIX_POLICIES


def test_register_create_aliases_and_names():
    reg: Registry[tuple] = Registry("widget")

    @reg.register("plain")
    def plain(*args, **kw):
        return ("plain", args, kw)

    @reg.register("fancy", aliases=("f", "Fan"))
    class Fancy:
        def __init__(self, size=1):
            self.size = size

    assert reg.names() == ("plain", "fancy")  # canonical names, registration order; aliases not listed
    assert reg.create("plain", 1, k=2) == ("plain", (1,), {"k": 2})
    assert reg.create("FAN", size=3).size == 3 and isinstance(reg.create("f"), Fancy)  # aliases, any case
    assert reg.canonical("F") == "fancy" and reg.get("fancy") is Fancy
    assert "Fancy" in reg and "fan" in reg and "nope" not in reg and 3 not in reg
    with pytest.raises(UnknownName, match=r"unknown widget 'nope'; choose from plain, fancy"):
        reg.create("nope")
    assert issubclass(UnknownName, ValueError)
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("other", aliases=("plain",))(plain)
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("F")(plain)


def test_config_choices_are_the_registered_names():
    assert set(config.RANKING_POLICIES) == set(PREFIX_POLICIES.names())
    assert set(config.LLM_SCHEDULERS) == set(LLM_SCHEDULERS.names()) == set(SCHEDULERS)
    assert set(DATASETS) == set(LENGTH_DISTRIBUTIONS.names()) == {"sharegpt", "humaneval", "longbench"}
    # the prefix cache offers the eviction policies that need no oracle of the future
    assert set(config.PREFIX_CACHE_POLICIES) <= set(EVICTION_POLICIES.names())
    for name in config.PREFIX_CACHE_POLICIES:
        assert PrefixKVStore(16, 1, 4, policy=name).tree.policy.name == name


def test_the_product_registers_exactly_the_selectable_eviction_policies():
    """Every eviction policy grserve itself registers is one a serving flag can select (--prefix-cache-policy); the
    lab adds the offline ones (Belady needs the future, FPB / HF are baselines) when it is loaded."""
    code = ("import sys; from grserve.eviction import EVICTION_POLICIES; "
            "assert not any(m.startswith('grserve_bench') for m in sys.modules); print(*EVICTION_POLICIES.names())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert sorted(out) == sorted(config.PREFIX_CACHE_POLICIES)
    import grserve_bench.eviction  # noqa: F401 - registers the lab's policies

    assert set(EVICTION_POLICIES.names()) == set(config.PREFIX_CACHE_POLICIES) | {"belady", "fpb", "hf"}


def test_every_registered_policy_reports_its_name():
    for name in LLM_SCHEDULERS.names():
        assert make_llm_scheduler(name).name == name.removesuffix("-kv")
    assert make_llm_scheduler("aptserve-kv").hybrid is False and make_llm_scheduler("aptserve").hybrid is True
    for name in PREFIX_POLICIES.names():
        assert PREFIX_POLICIES.create(name).name == name
    assert EVICTION_POLICIES.canonical("opt") == "belady"
