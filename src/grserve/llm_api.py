"""The offline LLM API in vLLM's ``LLM`` shape: ``LLM(model).generate(prompts, sampling_params)``.

It runs the engine ``grserve serve llm`` runs (``AsyncLLMEngine.build`` from the same ``LLMServeConfig``: the
continuous-batching core, its scheduler, the hybrid KV/hidden pool, the prefix cache), in-process. A prompt is a
string (encoded as ``/v1/completions`` encodes it), a list of token ids, or vLLM's ``{"prompt": str}`` /
``{"prompt_token_ids": [...]}``; ``sampling_params`` is one ``SamplingParams`` for all prompts or one per prompt.
``chat(conversations)`` renders each conversation with the model's chat template as ``/v1/chat/completions`` does.

Every prompt is submitted to the running engine (at most ``window`` at a time, so memory stays bounded), which
batches them continuously, as it batches concurrent HTTP clients; the outputs come back in prompt order. A request
with a ``seed`` samples the same tokens whatever shares its batch (``engine/sampling.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from grserve.config import LLMApiConfig, LLMConfig, LLMServeConfig, ModelConfig
from grserve.engine.sampling import SamplingParams


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


def llm_config(model: str = "tiny-mha", **kwargs: Any) -> LLMServeConfig:
    """An ``LLMServeConfig`` from keyword arguments named like ``grserve serve llm``'s flags (``dtype``, ``device``,
    ``scheduler``, ``num_blocks``, ``prefix_cache_tokens``, ``tokenizer``, ...)."""
    parts: dict[type, dict] = {ModelConfig: {"source": model}, LLMConfig: {}, LLMApiConfig: {}}
    names = {f.name: cls for cls in (ModelConfig, LLMConfig, LLMApiConfig) for f in fields(cls) if f.name != "source"}
    for key, value in kwargs.items():
        if key not in names:
            raise TypeError(f"unknown setting {key!r} (settings are grserve serve llm's flags, e.g. dtype, "
                            f"scheduler, num_blocks, tokenizer)")
        parts[names[key]][key] = value
    return LLMServeConfig(model=ModelConfig(**parts[ModelConfig]), llm=LLMConfig(**parts[LLMConfig]),
                          api=LLMApiConfig(**parts[LLMApiConfig]))


class LLM:
    def __init__(self, model: str = "tiny-mha", *, config: LLMServeConfig | None = None, **kwargs: Any):
        from grserve.engine.async_llm import AsyncLLMEngine

        self.config = config if config is not None else llm_config(model, **kwargs)
        self.engine = AsyncLLMEngine.build(self.config)
        self.tokenizer = self.engine.tokenizer
        self.engine.start()

    @property
    def dtype_choice(self):
        """The dtype the model runs in and why (``model/dtype_choice.py``: ``--dtype auto`` resolved)."""
        return getattr(self.engine.model, "dtype_choice", None)

    def close(self) -> None:
        self.engine.stop()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, window: int | None = None) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in prompt order."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]  # one prompt given as token ids
        params = _params_per_prompt(sampling_params, len(prompts))
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        return self._run(encoded, params, use_tqdm, window or 2 * self.config.llm.max_num_seqs)

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}``) or several; rendered with the chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in convs]
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        return self.generate([{"prompt_token_ids": i, "prompt": t} for i, t in zip(ids, texts)], sampling_params,
                             use_tqdm=use_tqdm)

    def _encode(self, prompt: Any, index: int) -> tuple[str | None, list[int]]:
        from grserve.inputs.refusal import ApiError, token_ids

        vocab = int(self.engine.model.spec.vocab_size)
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt if isinstance(prompt, str) else None
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if ids is None and not isinstance(prompt, (str, dict)):
            ids = list(prompt)
        if ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt {index}: a string, token ids, or a dict with 'prompt' or 'prompt_token_ids'")
            return text, list(self.tokenizer.encode(text))
        try:
            return text, token_ids(list(ids), vocab, f"prompts[{index}]").tolist()
        except ApiError as exc:
            raise ValueError(exc.message) from None

    def _run(self, encoded, params, use_tqdm: bool, window: int) -> list[RequestOutput]:
        from grserve.engine.types import LLMRequest

        outputs: list[RequestOutput] = []
        live: deque = deque()
        bar = _bar(use_tqdm, len(encoded))
        try:
            for (text, ids), p in zip(encoded, params):
                if len(live) >= window:
                    outputs.append(self._collect(live.popleft(), bar))
                req = LLMRequest(prompt_ids=ids, params=p)
                live.append((req, text, self.engine.submit(req)))
            while live:
                outputs.append(self._collect(live.popleft(), bar))
        finally:
            for req, _, handle in live:
                self.engine.cancel(req.request_id)
            bar.close()
        return outputs

    @staticmethod
    def _collect(entry, bar) -> RequestOutput:
        req, text, handle = entry
        res = handle.future.result()
        bar.update(1)
        return RequestOutput(req.request_id, text, list(req.prompt_ids),
                             [CompletionOutput(0, res.text, list(res.output_ids), res.finish_reason)])


def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts (give one, or one per prompt)")
    return params


def _bar(show: bool, total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="prompt", disable=None if show else True,
                dynamic_ncols=True)  # disable=None: no bar when stderr is not a terminal
