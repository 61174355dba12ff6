"""grserve: inference serving for generative recommenders and LLMs.

The offline API (``docs/offline-eval.md``), imported on first use so that ``import grserve`` stays light (no torch)::

    from grserve import Recommender
    rec = Recommender(model="model_dir", catalog="catalog.jsonl", beam_width=100)
    top = rec.recommend([[12, 7, 99], {"history_items": [3, 4], "top_n": 5}])

``LLM(model).generate(prompts, SamplingParams(...))`` is the LLM counterpart (vLLM's ``LLM`` shape).
"""

__version__ = "0.1.0"

_EXPORTS = {
    "Recommender": "grserve.recommender",
    "Recommendation": "grserve.recommender",
    "RecommendedItem": "grserve.recommender",
    "RecommendInputError": "grserve.recommender",
    "serve_config": "grserve.recommender",
    "LLM": "grserve.llm_api",
    "RequestOutput": "grserve.llm_api",
    "CompletionOutput": "grserve.llm_api",
    "llm_config": "grserve.llm_api",
    "SamplingParams": "grserve.engine.sampling",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'grserve' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
