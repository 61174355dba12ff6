"""The LLM server's request metrics in vLLM's style, labelled by ``model_name``: TTFT, inter-token and
end-to-end latency histograms, prompt and generation token counters, finished requests by reason, and errors
by status class (4xx, 5xx; a streamed request that fails after its 200 counts as 5xx).

Names (Prometheus, in the app's own registry): ``grserve_llm_time_to_first_token_seconds``,
``grserve_llm_inter_token_latency_seconds``, ``grserve_llm_e2e_request_latency_seconds`` (histograms, vLLM's
buckets), ``grserve_llm_prompt_tokens_total``, ``grserve_llm_generation_tokens_total``,
``grserve_llm_request_success_total{finished_reason}``, ``grserve_llm_request_errors_total{status}``.
Times are measured at the server (what a client sees, less the network): from the request's validation to each
token event. A finished request's phases in the engine, as vLLM splits them, come from its result (the engine's
clock): ``grserve_llm_request_queue_time_seconds`` (arrival → first scheduled),
``grserve_llm_request_prefill_time_seconds`` (→ first token), ``grserve_llm_request_decode_time_seconds`` (first →
last token).

**vLLM's names too.** Every family above is also served under vLLM's name (``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds`` and its older alias ``vllm:time_per_output_token_seconds``,
``vllm:e2e_request_latency_seconds``, ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:request_success_total{finished_reason}``, ``vllm:request_{queue,prefill,decode,inference}_time_seconds``),
with the same ``model_name`` label, so a vLLM dashboard or alert reads grserve unchanged; both families also have
vLLM's per-request histograms ``request_prompt_tokens``, ``request_generation_tokens`` (per generated sequence),
``request_params_n`` and ``request_params_max_tokens``. The engine's gauges and counters under vLLM's names
(``vllm:num_requests_running`` …) are ``server/http/engine_metrics.py``'s.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1) + E2E_BUCKETS  # vLLM's request buckets, finer below 0.3 s
PHASES = (("queue_s", "queue", "arrival in the engine → first scheduled"),
          ("prefill_s", "prefill", "first scheduled → first token"),
          ("decode_s", "decode", "first token → last token"),
          ("inference_s", "inference", "first scheduled → last token (prefill + decode)"))
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
PREFIXES = ("grserve_llm_", "vllm:")  # every family under grserve's name and vLLM's


def token_buckets(max_len: int) -> tuple[int, ...]:
    """vLLM's buckets of a token-count histogram: 1, 2, 5, 10, 20, 50, ... up to ``max_len``."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return tuple(out) or (1,)
            out.append(m * scale)
        scale *= 10


class Fan:
    """One metric kept under several names: ``observe`` / ``inc`` / ``labels`` reach each."""

    def __init__(self, children: list[Any]) -> None:
        self.children = children

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)

    def inc(self, amount: float = 1.0) -> None:
        for c in self.children:
            c.inc(amount)

    def labels(self, *values: str) -> "Fan":
        return Fan([c.labels(*values) for c in self.children])


class LLMMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int = 4096) -> None:
        lab = ["model_name"]
        self.model_name = model_name

        def both(kind: type, name: str, help_text: str, labels: list[str] = lab, aliases: tuple[str, ...] = (),
                 **kw: Any) -> Fan:
            names = [p + name for p in PREFIXES] + [f"vllm:{a}" for a in aliases]
            return Fan([kind(n, help_text, labels, registry=registry, **kw) for n in names])

        self.ttft = both(Histogram, "time_to_first_token_seconds", "Time to the first generated token.",
                         buckets=TTFT_BUCKETS).labels(model_name)
        self.itl = both(Histogram, "inter_token_latency_seconds", "Time between two token events of a request.",
                        aliases=("time_per_output_token_seconds",), buckets=ITL_BUCKETS).labels(model_name)
        self.e2e = both(Histogram, "e2e_request_latency_seconds", "Request latency (validated → finished).",
                        buckets=E2E_BUCKETS).labels(model_name)
        self.prompt_tokens = both(Counter, "prompt_tokens", "Prompt tokens of finished or failed requests."
                                  ).labels(model_name)
        self.generation_tokens = both(Counter, "generation_tokens", "Generated tokens.").labels(model_name)
        self.success = both(Counter, "request_success", "Finished requests by finish reason.",
                            lab + ["finished_reason"])
        self.errors = Counter("grserve_llm_request_errors", "Failed requests by status class (4xx, 5xx).",
                              lab + ["status"], registry=registry)
        self.phases = {key: both(Histogram, f"request_{name}_time_seconds", f"Time of a finished request in the "
                                 f"engine, {what}.", buckets=PHASE_BUCKETS).labels(model_name)
                       for key, name, what in PHASES}
        tokens = token_buckets(max_model_len)
        self.request_prompt = both(Histogram, "request_prompt_tokens", "Prompt tokens of a request.",
                                   buckets=tokens).labels(model_name)
        self.request_generation = both(Histogram, "request_generation_tokens", "Tokens generated for one sequence "
                                       "of a request.", buckets=tokens).labels(model_name)
        self.params_n = both(Histogram, "request_params_n", "The n of a request.", buckets=PARAMS_N_BUCKETS
                             ).labels(model_name)
        self.params_max_tokens = both(Histogram, "request_params_max_tokens", "The max_tokens of a request.",
                                      buckets=tokens).labels(model_name)

    def timer(self, prompt_tokens: int) -> "RequestTimer":
        return RequestTimer(self, prompt_tokens)

    def request(self, n: int, max_tokens: int) -> None:
        """A request's sampling parameters, once per admitted request."""
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)

    def error(self, status: int) -> None:
        self.errors.labels(self.model_name, f"{status // 100}xx").inc()


class RequestTimer:
    """The timings of one generated sequence (one choice)."""

    def __init__(self, metrics: LLMMetrics, prompt_tokens: int) -> None:
        self.m, self.prompt = metrics, prompt_tokens
        self.start = time.perf_counter()
        self.last: float | None = None
        self.generated = 0
        self.ended = False

    def on_event(self, ev: Any) -> None:
        if not ev.token_ids:
            return
        now = time.perf_counter()
        (self.m.ttft if self.last is None else self.m.itl).observe(now - (self.start if self.last is None
                                                                            else self.last))
        self.last = now
        self.generated += len(ev.token_ids)
        self.m.generation_tokens.inc(len(ev.token_ids))

    def done(self, reason: str) -> None:
        if not self.ended:
            self.ended = True
            self.m.e2e.observe(time.perf_counter() - self.start)
            self._tokens()
            self.m.success.labels(self.m.model_name, reason).inc()

    def phases(self, result: Any) -> None:
        """Observe a finished request's engine phases (those its result reports)."""
        for key, histogram in self.m.phases.items():
            if key == "inference_s":
                parts = [getattr(result, k, None) for k in ("prefill_s", "decode_s")]
                seconds = None if None in parts else sum(parts)
            else:
                seconds = getattr(result, key, None)
            if seconds is not None:
                histogram.observe(max(float(seconds), 0.0))

    def failed(self) -> None:
        if not self.ended:
            self.ended = True
            self._tokens()

    def _tokens(self) -> None:
        self.m.prompt_tokens.inc(self.prompt)
        if self.prompt:  # the prompt is counted once per request (the first sequence's timer)
            self.m.request_prompt.observe(self.prompt)
        self.m.request_generation.observe(self.generated)


class StatusCounter:
    """Pure-ASGI middleware: every 4xx/5xx answer of the app counts in ``grserve_llm_request_errors_total``."""

    def __init__(self, app: Any, metrics: LLMMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        started = [False]

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                started[0] = True
                status = int(message["status"])
                if status >= 400 and status != 499:  # 499: the client left (not an error of the server's)
                    self.metrics.error(status)
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            if not started[0]:  # answered 500 by the outermost error middleware
                self.metrics.error(500)
            raise
