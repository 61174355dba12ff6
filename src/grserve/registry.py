"""By-name registries: the one way grserve picks an implementation (a policy) from a name in config.

A family of policies declares one ``Registry`` next to its interface, and every implementation registers itself
where it is defined::

    EVICTION_POLICIES = Registry("eviction policy")              # eviction/policy.py, beside EvictionPolicy

    @EVICTION_POLICIES.register("belady", aliases=("opt",))      # grserve_bench/eviction/belady.py
    class BeladyPolicy(EvictionPolicy): ...

    EVICTION_POLICIES.create("opt", capacity, oracle=o)          # BeladyPolicy(capacity, oracle=o)

What is registered is any callable that builds one (a class, or a function for a variant such as Apt-Serve with
the KV cache only). ``names()`` lists the canonical names in registration order (what config choices and
``--help`` show; aliases are accepted by ``create`` but not listed); an unknown name raises :class:`UnknownName`
(a ``ValueError``) that lists the choices. Names are matched case-insensitively.

The families: ``eviction.policy.EVICTION_POLICIES`` (LRU, LFU, LARU, density, leader; the lab package adds
Belady, FPB, HF), ``scheduler.prefix_choice.PREFIX_POLICIES`` (BAT and its baselines),
``scheduler.llm_types.LLM_SCHEDULERS`` (FCFS, chunked prefill, Apt-Serve); in the lab package,
``grserve_bench.llm_workloads.LENGTH_DISTRIBUTIONS`` (the LLM workloads' datasets).
This module sits at the bottom of the house with ``config.py`` and ``flags.py``: it imports nothing of grserve.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class UnknownName(ValueError):
    """A name no implementation was registered under; the message lists the choices."""


class Registry(Generic[T]):
    """Named factories of one kind (``kind`` names it in error messages, e.g. "eviction policy")."""

    def __init__(self, kind: str):
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, *, aliases: Iterable[str] = ()) -> Callable[[F], F]:
        """Decorator: register the class or function under ``name`` (and ``aliases``); returns it unchanged."""

        def add(factory: F) -> F:
            key = name.lower()
            for taken in (key, *(a.lower() for a in aliases)):
                if taken in self._factories or taken in self._aliases:
                    raise ValueError(f"{self.kind} {taken!r} is registered twice")
            self._factories[key] = factory
            self._aliases.update({a.lower(): key for a in aliases})
            return factory

        return add

    def names(self) -> tuple[str, ...]:
        """The canonical names, in registration order."""
        return tuple(self._factories)

    def canonical(self, name: str) -> str:
        """The canonical name of ``name`` (itself or the name an alias stands for); ``UnknownName`` if none."""
        key = self._aliases.get(name.lower(), name.lower())
        if key not in self._factories:
            raise UnknownName(f"unknown {self.kind} {name!r}; choose from {', '.join(self.names())}")
        return key

    def get(self, name: str) -> Callable[..., T]:
        """The factory registered under ``name`` (or an alias)."""
        return self._factories[self.canonical(name)]

    def create(self, name: str, *args: Any, **kw: Any) -> T:
        """Build the implementation registered under ``name``: ``factory(*args, **kw)``."""
        return self.get(name)(*args, **kw)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._aliases.get(name.lower(), name.lower()) in self._factories

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"
