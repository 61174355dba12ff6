"""LLM engine runs the decode and prefix tests share: a scheduler that preempts on purpose, and a run in which
requests join a running batch, finish at different steps and (with ``Preempting``) are preempted."""

from __future__ import annotations

from grserve.engine.llm import build_model_engine
from grserve.scheduler.llm_types import SchedulerOutput


class Preempting:
    """Wraps a scheduler; every ``every``-th iteration it preempts the newest running request instead."""

    name = "preempting"

    def __init__(self, inner, every: int = 4):
        self.inner, self.every, self.i = inner, every, 0

    def schedule(self, inp):
        self.i += 1
        if self.i % self.every == 0 and len(inp.running) >= 2:
            return SchedulerOutput("decode", [], [inp.running[-1].seq_id])
        return self.inner.schedule(inp)


def run_joining(ours, policy, prompts, params, **engine_kw):
    """Four requests start, three steps later the rest join; run to the end. Returns (the output ids in request
    order, the engine)."""
    eng = build_model_engine(ours, policy, num_blocks=96, block_size=4, **engine_kw)
    eng.keep_finished = True
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts[:4], params[:4])]
    for _ in range(3):
        eng.step()
    ids += [eng.add_request(p, sp) for p, sp in zip(prompts[4:], params[4:])]  # join a running batch
    while eng.has_work():
        eng.step()
    done = {s.seq_id: s.output_ids for s in eng.finished}
    return [done[i] for i in ids], eng
