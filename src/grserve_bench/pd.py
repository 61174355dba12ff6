"""``grserve bench pd``: prefill/decode disaggregation, role flips and online/offline co-location (issue 13).

Three parts, each its own module with its own flags (``--parts`` picks which run):

- ``real`` (``grserve_bench/pd_real.py``): 3 tiny instances on Ray, a long-prompt phase then a long-output phase; flips
  each way, KV bytes moved, lost requests, outputs equal to the no-PD run;
- ``colocation`` (``grserve_bench/pd_colocation.py``): online load at ~60 % of capacity plus an offline backlog, against
  online alone and offline alone;
- ``sim`` (``grserve_bench/pd_sim.py``): goodput of static PD, dynamic PD and co-located serving at GPU scale in the
  discrete-event simulator, on a stable and a bursty arrival trace.

The last line is one JSON object: the keys of every part that ran.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import ModuleType

from grserve.flags import Checked, add_flags, comma_list, command_parser, flag, from_args

PARTS = ("real", "colocation", "sim")


@dataclass(frozen=True)
class PDBenchConfig(Checked):
    parts: str = flag(",".join(PARTS), "parts to run, comma-separated: real, colocation, sim",
                      check=comma_list(allowed=PARTS), metavar="LIST")


def _parts() -> dict[str, ModuleType]:
    from grserve_bench import pd_colocation, pd_real, pd_sim

    return {"real": pd_real, "colocation": pd_colocation, "sim": pd_sim}


def add_command(sub) -> None:
    p = command_parser(sub, "pd", help="PD disaggregation with role flips, co-location, and simulated goodput",
                       description=__doc__)
    add_flags(p, PDBenchConfig)
    for name, mod in _parts().items():
        add_flags(p, mod.PartConfig, title=f"part '{name}'")
    p.set_defaults(handler=lambda ns: run(from_args(PDBenchConfig, ns),
                                          {n: from_args(m.PartConfig, ns) for n, m in _parts().items()}))


def run(cfg: PDBenchConfig, part_cfgs: dict | None = None) -> int:
    mods = _parts()
    result: dict = {}
    for name in cfg.parts.split(","):
        mod = mods[name]
        pc = (part_cfgs or {}).get(name) or mod.PartConfig()
        result.update(mod.run_part(pc))
    print(json.dumps(result), flush=True)
    return 0
