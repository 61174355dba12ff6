"""The cluster's Prometheus metrics on the front end's ``/metrics`` (a collector read at scrape time).

Per instance (label ``instance``): up, running, waiting, free blocks, prefix-hit and prefill tokens, requests
routed there, the load the router has booked on it. Router: decisions by reason, prompt tokens the index promised
cached at the chosen instance. Recovery: instance deaths, migrations, recomputes, requests lost. KV index: blocks,
events applied and ignored, gaps, snapshots.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_INSTANCE_STATS = (("running", "Requests holding cache blocks."), ("waiting", "Requests waiting."),
                   ("free_blocks", "Free blocks in the pool."),
                   ("prefix_hit_tokens", "Prompt tokens copied from the prefix cache."),
                   ("prefill_tokens", "Prompt tokens computed."))


class ClusterCollector:
    def __init__(self, engine) -> None:
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        e = self.engine
        yield from self._instances(e)
        r = e.router
        dec = CounterMetricFamily("grserve_cluster_routing_decisions", "Routing decisions by reason.",
                                  labels=["reason"])
        for reason, n in r.decisions.items():
            dec.add_metric([reason], n)
        yield dec
        yield CounterMetricFamily("grserve_cluster_routed_cached_tokens", "Prompt tokens the KV index said were "
                                  "cached at the chosen instance.", value=r.cached_tokens_routed)
        for key, name, help_text in (("migrated", "migrations", "Requests moved with their KV snapshot."),
                                     ("recomputed", "recomputes", "Requests moved and recomputed."),
                                     ("lost", "lost_requests", "Requests failed after instance deaths."),
                                     ("instance_deaths", "instance_deaths", "Instances taken out (dead/fenced)."),
                                     ("restarts", "instance_restarts", "Dead instances restarted (new actor, "
                                      "new incarnation).")):
            yield CounterMetricFamily(f"grserve_cluster_{name}", help_text, value=e.counters[key])
        idx = e.index
        yield GaugeMetricFamily("grserve_cluster_kv_index_blocks", "Blocks in the global KV index.",
                                value=len(idx.blocks))
        for key in ("events", "ignored_events", "gaps", "snapshots"):
            yield CounterMetricFamily(f"grserve_cluster_kv_index_{key}", f"KV index: {key.replace('_', ' ')}.",
                                      value=idx.stats[key])
        if getattr(e, "pd", None) is not None:
            from grserve.cluster.llm.pd_roles import pd_metrics

            yield from pd_metrics(e.pd)

    def _instances(self, e):
        up = GaugeMetricFamily("grserve_cluster_instance_up", "1 while the instance serves.", labels=["instance"])
        routed = CounterMetricFamily("grserve_cluster_instance_routed", "Requests routed to the instance.",
                                     labels=["instance"])
        booked = GaugeMetricFamily("grserve_cluster_instance_booked_tokens", "Load the router has booked.",
                                   labels=["instance", "phase"])
        fams = {k: GaugeMetricFamily(f"grserve_cluster_instance_{k}", h, labels=["instance"])
                for k, h in _INSTANCE_STATS}
        for inst in e.instances:
            i = str(inst.index)
            up.add_metric([i], 1.0 if inst.up else 0.0)
            routed.add_metric([i], e.router.routed[inst.index])
            ld = e.router.load[inst.index]
            booked.add_metric([i, "prefill"], ld.prefill_tokens)
            booked.add_metric([i, "decode"], ld.decode_tokens)
            for k, fam in fams.items():
                fam.add_metric([i], float(inst.stats.get(k, 0)))
        yield up
        yield routed
        yield booked
        yield from fams.values()
