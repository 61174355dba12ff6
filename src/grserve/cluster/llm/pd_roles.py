"""The runtime instance monitor and dynamic role flips of the real cluster (xLLM §3.2, digest §3.3).

``RoleMonitor.tick`` runs on the front end after each instance poll (at most every ``interval_s``, under the
engine's lock). It gathers ``InstanceSignals`` — booked prefill tokens, booked decode requests and tokens (the
router's bookings), the recent token generation interval each instance measures itself (``TokenInterval`` in its
poll's stats) — and applies ``pd_policy.decide_flip`` with the TTFT predictor, the SLOs and ``PDConfig``
(``--role-flips``, ``--min-dwell-s``, ``--min-per-role``). A flip only moves the instance to the other pool
(``RolePools.flip``): same process, same model, no reload; requests running there finish there, new ones follow
the pools. Each flip is logged (one line) and counted (``grserve_cluster_role_flips_total{direction}``); each
instance's pool is a gauge (``grserve_cluster_instance_role{instance, role, pool}``). A dead instance never flips
and does not count toward ``min_per_role`` (``RolePools.set_alive``, synced before each decision).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from grserve.cluster.llm.pd_policy import Role, decide_flip, pool_tpot

if TYPE_CHECKING:
    from collections.abc import Iterator

    from prometheus_client.metrics_core import Metric

    from grserve.cluster.llm.pd_disagg import PDCoordinator

log = logging.getLogger("grserve.cluster")


class RoleMonitor:
    def __init__(self, coord: PDCoordinator, interval_s: float = 0.05):
        self.coord = coord
        self.interval_s = interval_s
        self._last = 0.0
        self.log: list[dict] = []  # every flip: time, instance, from/to pool, the signals that caused it

    def tick(self, now: float | None = None) -> tuple[int, Role] | None:
        c = self.coord
        now = time.monotonic() if now is None else now
        if now - self._last < self.interval_s:
            return None
        self._last = now
        for inst in c.engine.instances:  # min_per_role counts live instances only
            c.pools.set_alive(inst.index, inst.up)
        sig = c.signals()
        slo = c.plan_slo()
        d = decide_flip(c.pools, sig, c.ttft, slo, c.cfg, now, input_tokens=c.ttft_probe(now))
        if d is None or not c.engine.instances[d[0]].up:
            return None
        i, role = d
        old = c.pools.pool(i)
        tp = pool_tpot(c.pools, sig)
        short = any(sig[j].waiting_decode_requests > 0 for j in c.pools.members(Role.DECODE))
        cause = ("TTFT" if role is Role.PREFILL else "memory" if short
                 else "TPOT" if tp is not None and tp > slo.tpot_slo_s else "idle")
        c.pools.flip(i, now)
        entry = {"t": now, "instance": i, "from": old, "to": c.pools.pool(i), "role": role.value, "cause": cause,
                 "queued_prefill_tokens": {j: v.queued_prefill_tokens for j, v in sig.items()},
                 "token_interval_s": {j: v.recent_tpot_s for j, v in sig.items()}}
        self.log.append(entry)
        log.warning("PD role flip: instance %d %s -> %s (%s; queued prefill tokens %s, token interval %s)", i, old,
                    c.pools.pool(i), cause,
                    entry["queued_prefill_tokens"], {j: None if v is None else round(v, 4)
                                                     for j, v in entry["token_interval_s"].items()})
        return d


def pd_metrics(coord: PDCoordinator) -> Iterator[Metric]:
    """The PD families on ``/metrics`` (``cluster/core/metrics.py`` yields them when ``--pd`` is on)."""
    flips = CounterMetricFamily("grserve_cluster_role_flips", "PD role flips by direction.", labels=["direction"])
    for k, n in coord.pools.flips.items():
        flips.add_metric([k], n)
    yield flips
    role = GaugeMetricFamily("grserve_cluster_instance_role", "1 for the instance's current role and pool.",
                             labels=["instance", "role", "pool"])
    for i in range(coord.pools.n):
        role.add_metric([str(i), coord.pools.role(i).value, coord.pools.pool(i)], 1.0)
    yield role
    for key, name, help_text in (("splits", "pd_splits", "Requests split: prefill and decode on two instances."),
                                 ("whole", "pd_whole", "Requests not split (short uncached prompt)."),
                                 ("handoffs", "pd_handoffs", "KV hand-offs from a prefill to a decode instance."),
                                 ("kv_bytes_moved", "pd_kv_bytes_moved", "KV bytes moved by PD hand-offs."),
                                 ("kv_tokens_moved", "pd_kv_tokens_moved", "Prompt tokens whose KV was moved.")):
        yield CounterMetricFamily(f"grserve_cluster_{name}", help_text, value=coord.counters[key])
    yield GaugeMetricFamily("grserve_cluster_pd_split_min_tokens", "The split threshold (uncached tokens).",
                            value=coord.threshold)
