"""Where a decode step of the tiny LLM goes (issue 43 item 2): a per-step breakdown, TPOT and output tok/s.

    PYTHONPATH=src .venv/bin/python scripts/decode_profile.py                       # c8 and c32, greedy
    PYTHONPATH=src .venv/bin/python scripts/decode_profile.py --temperature 0.8 --top-p 0.95
    PYTHONPATH=src .venv/bin/python scripts/decode_profile.py --torch-profile       # + torch.profiler's op table

The engine ``grserve serve llm`` builds (``AsyncLLMEngine.build``: the preset model with seeded weights, its
scheduler, pool, executor and tokenizer) is driven directly, on this thread, without the step loop's thread or
HTTP: ``concurrency`` requests of ``--prompt`` random tokens each are added at once and stepped until they finish
(``--max-tokens`` each, ``ignore_eos``), ``--rounds`` times (the first round is warm-up and not counted).

Timers (this thread's CPU time, ``time.thread_time``, so other tenants of the machine do not count; with the
default ``--threads 1`` every op runs on this thread; ``--clock wall`` for wall time) around the parts of
``LLMEngine.step``, wrapped at run time (the wrappers are the only change), split each decode step (a step whose every request computes one token) into:

* ``scheduler``: the policy's ``schedule`` and the ``SchedulerInput`` built for it;
* ``attention index building``: the attention context's construction (block tables → rows, masks, positions);
* ``attention``: the context's ``attend`` over every layer (K/V writes, staging, SDPA);
* ``model math``: the rest of the model forward (embedding, norms, projections, RoPE, MLP);
* ``greedy head``: the screened LM head (greedy passes), or ``logits`` (the full LM head, sampled passes);
* ``sampler``: ``LLMEngine._sample`` (logit processing, the draw);
* ``token events``: appending tokens, stop rules, detokenization, events;
* ``other Python``: the step minus the parts above (the executor's token/position lists, block-table growth,
  bookkeeping of the step).

TPOT is (last token time − first token time) / (tokens − 1) per request, median over requests; output tok/s is
the decode tokens of a round over its wall time from the first decode step. Pass ``--fast-index 0|1`` to force
the pure-decode index path (``attention/hybrid.py``'s ``FAST_DECODE_INDEX``) for an A/B in one process, and
``--decode-compile on --ab`` to alternate the compiled decode step (``model/decode_compile.py``) with the eager one
round by round in one process (the compiled stack's forward is timed as the model's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

import torch

CLOCK = time.thread_time  # the breakdown: this thread's CPU time (robust to other tenants); --clock wall
PARTS = ("scheduler", "attention index building", "attention", "model math", "greedy head", "logits", "sampler",
         "token events", "other Python")


class Timers:
    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, obj, name: str, part: str) -> None:
        fn = getattr(obj, name)
        timers = self

        def timed(*a, **kw):
            if not timers.on:
                return fn(*a, **kw)
            t = CLOCK()
            try:
                return fn(*a, **kw)
            finally:
                timers.acc[part] += CLOCK() - t

        object.__setattr__(obj, name, timed)  # on the instance itself (a wrapper policy forwards setattr)


def instrument(core, ex, sampled: bool) -> tuple["Timers", "Timers"]:
    """Wrap the engine's parts in timers (the breakdown of the module docstring): (the parts' timers, the
    whole forward's); the attention context class is replaced by a timed subclass."""
    t = Timers()
    t.wrap(core.scheduler, "schedule", "scheduler")
    t.wrap(core, "scheduler_input", "scheduler")
    t.wrap(core, "_sample", "sampler")
    t.wrap(core, "_append_token", "token events")
    t.wrap(ex.model, "logits", "logits")
    if ex.greedy_head is not None:
        t.wrap(ex.greedy_head, "argmax", "greedy head")
    if getattr(ex, "dtype_head", None) is not None:  # a bf16 model: greedy passes pick (its logits inside)
        t.wrap(ex.dtype_head, "pick", "greedy head")
        if sampled:
            t.wrap(ex.dtype_head, "logits", "logits")
    forward = Timers()  # the whole forward (the model math is it minus attention and index building)
    forward.wrap(ex.model, "forward", "forward")
    if getattr(ex, "decode_compiled", None) is not None:  # --decode-compile: the compiled stack is the forward
        forward.wrap(ex.decode_compiled, "forward", "forward")
    from grserve.engine import llm as llm_mod

    ctx_cls = llm_mod.HybridPagedContext

    class TimedContext(ctx_cls):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **kw):
            s = CLOCK()
            super().__init__(*a, **kw)
            if t.on:
                t.acc["attention index building"] += CLOCK() - s

        def attend(self, *a, **kw):
            s = CLOCK()
            try:
                return super().attend(*a, **kw)
            finally:
                if t.on:
                    t.acc["attention"] += CLOCK() - s

    llm_mod.HybridPagedContext = TimedContext
    return t, forward


def report(conc: int, res: dict, ex, clock: str) -> None:
    """Print one concurrency's breakdown per mode (ms per decode step), TPOT p50 and output tok/s."""
    for m, (acc, tpot, tps, steps) in res.items():
        steps = steps[0]
        acc["model math"] = acc.pop("forward") - acc.get("attention", 0.0)
        named = sum(acc.get(p, 0.0) for p in PARTS if p != "other Python")
        acc["other Python"] = acc["step"] - named
        label = f" ({m} decode step)" if m else ""
        print(f"\n## concurrency {conc}{label}: {steps} decode steps, load {os.getloadavg()[0]:.2f}")
        print(f"| ms of {clock} time per decode step | |\n|---|---|")
        for p in PARTS:
            if acc.get(p):
                print(f"| {p} | {acc[p] / steps * 1e3:.3f} |")
        print(f"| **step** | **{acc['step'] / steps * 1e3:.3f}** |")
        if ex.greedy_head is not None:
            print(f"greedy head: {ex.greedy_head.stats}")
        print(f"TPOT p50 {statistics.median(tpot) * 1e3:.2f} ms; output {statistics.median(tps):.0f} tok/s "
              f"(median of {len(tpot)} rounds: TPOT {', '.join(f'{x * 1e3:.2f}' for x in tpot)})", flush=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per concurrency, the first one warm-up")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fast-index", type=int, choices=(0, 1), default=None)
    ap.add_argument("--decode-compile", choices=("auto", "on", "off"), default="off",
                    help="serve llm's --decode-compile (model/decode_compile.py; warm-up before the rounds)")
    ap.add_argument("--ab", action="store_true",
                    help="with --decode-compile on: rounds alternate the compiled and the eager decode step (one "
                         "process, same engine and load: an A/B on a shared machine)")
    ap.add_argument("--kernel-ab", action="store_true",
                    help="rounds alternate the C++ decode attention kernel and SDPA on the staging buffer "
                         "(attention/decode_kernel.py; one process: an A/B on a shared machine)")
    ap.add_argument("--greedy-band", choices=("chunks", "topk"), default=None,
                    help="the greedy head's candidate search (engine/greedy_head.py); default: the head's own")
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread",
                    help="the breakdown's clock: this thread's CPU time (default) or wall time")
    ap.add_argument("--batch-invariant", type=int, choices=(0, 1), default=None,
                    help="the engine's --batch-invariant (attention/hybrid.py); default: the config's default")
    ap.add_argument("--torch-profile", action="store_true", help="also print torch.profiler's top ops (1 round)")
    return ap.parse_args()


def main() -> int:
    args = parse_args()

    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.thread_time if args.clock == "thread" else time.perf_counter
    from grserve.attention import hybrid
    from grserve.engine.async_llm import AsyncLLMEngine
    from grserve.engine.sampling import SamplingParams
    from grserve.llm_api import llm_config
    from grserve.model.cpu_support import cpu_support

    if args.fast_index is not None:
        hybrid.FAST_DECODE_INDEX = bool(args.fast_index)
    extra = {} if args.batch_invariant is None else {"batch_invariant": bool(args.batch_invariant)}
    t_build = time.perf_counter()
    eng = AsyncLLMEngine.build(llm_config(args.model, dtype=args.dtype, num_blocks=4096,
                                          decode_compile=args.decode_compile, **extra))
    t_build = time.perf_counter() - t_build
    core = eng.core
    ex = core.executor
    if args.greedy_band is not None and ex.greedy_head is not None:
        ex.greedy_head.band = args.greedy_band
    print(f"# {cpu_support().label()}; torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
          f"{args.model} {args.dtype}; {ex.describe()}; fast index "
          f"{getattr(hybrid, 'FAST_DECODE_INDEX', 'n/a')}; greedy band "
          f"{getattr(ex.greedy_head, 'band', 'n/a')}; batch invariant {getattr(ex, 'batch_invariant', 'n/a')}; "
          f"load {os.getloadavg()[0]:.2f}; engine built in {t_build:.1f} s", flush=True)

    t, forward = instrument(core, ex, args.temperature > 0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, ignore_eos=True, seed=None if args.temperature == 0 else 7)
    vocab = ex.model.spec.vocab_size
    gen = torch.Generator().manual_seed(0)

    def one_round(conc: int, count: bool) -> tuple[float, float, int]:
        prompts = [torch.randint(3, vocab - 1, (args.prompt,), generator=gen).tolist() for _ in range(conc)]
        core.keep_finished = True
        core.finished.clear()
        for p in prompts:
            core.add_request(p, params)
        decode_steps, t_first, tokens = 0, None, 0
        while core.has_work():
            decoding = bool(core.running) and not core.waiting and all(
                s.num_computed == s.num_tokens - 1 for s in core.running)
            t.on = forward.on = count and decoding
            s, w = CLOCK(), time.perf_counter()
            evs = core.step()
            if t.on:
                t.acc["step"] += CLOCK() - s
                decode_steps += 1
                tokens += len(evs)
                t_first = w if t_first is None else t_first
            t.on = forward.on = False
        wall = time.perf_counter() - t_first if t_first is not None else 0.0
        tpots = [(q.token_times[-1] - q.token_times[0]) / (len(q.token_times) - 1) for q in core.finished
                 if len(q.token_times) > 1]
        return statistics.median(tpots) if tpots else 0.0, tokens / wall if wall else 0.0, decode_steps

    dc = getattr(ex, "decode_compiled", None)
    # --ab: rounds alternate the compiled and the eager decode step in this one process (same engine, same load)
    modes = ("eager", "compiled") if args.ab and dc is not None else (None,)
    kernel = ex.staging.kernel if ex.staging is not None else None
    if args.kernel_ab and kernel is not None:  # --kernel-ab: the decode kernel against SDPA, alternating
        modes = ("sdpa", "kernel")
    for conc in args.concurrency:
        one_round(conc, False)  # warm-up
        res = {m: (defaultdict(float), [], [], [0]) for m in modes}
        for _ in range(args.rounds - 1):
            for m in modes:
                if m in ("sdpa", "kernel"):
                    ex.staging.kernel = kernel if m == "kernel" else None
                elif m is not None:
                    ex.decode_compiled = dc if m == "compiled" else None
                t.acc.clear()
                forward.acc.clear()
                a, b, n = one_round(conc, True)
                acc, tpot, tps, steps = res[m]
                for k, v in t.acc.items():
                    acc[k] += v
                acc["forward"] += forward.acc["forward"]
                tpot.append(a), tps.append(b)
                steps[0] += n
        ex.decode_compiled = dc
        if ex.staging is not None:
            ex.staging.kernel = kernel
        report(conc, res, ex, args.clock)
        if args.torch_profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                one_round(conc, False)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
