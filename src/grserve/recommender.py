"""The offline GR API: ``Recommender(...).recommend(requests)`` — many users' top items in-process.

It is the retrieval server without HTTP. ``Recommender`` builds the engine ``grserve serve`` builds, from the same
``ServeConfig`` (``Recommender.from_config``), or from keyword arguments named like the serve flags
(``model``, ``catalog``, ``dtype``, ``device``, ``beam_width``, ``scoring``, ``token_capacity``, ...). Each input is
turned into the engine's request by the function ``POST /v1/recommend`` uses (``inputs/retrieval.py``:
``retrieval_request``; the same schema, the same checks, the same error messages), so an input the server takes, the API takes, and the
results are the same (tested). An input is:

- a ``/v1/recommend`` body as a dict: ``{"history_items": [...], "top_n": 20, "exclude_items": [...]}``,
  ``{"history_sids": [[...], ...]}`` or ``{"history_tokens": [...]}`` (every field of the server's schema);
- a bare sequence of item ids (``[12, 7, 99]``: ``history_items``);
- a ``RecommendRequest``.
Text prompts and chat messages take the same path: when ``/v1/recommend`` accepts them (``prompt``/``messages``,
the tokenizer-native SID layouts), a ``str`` becomes ``{"prompt": s}`` and a list of ``{"role", "content"}``
dicts ``{"messages": m}`` here, with no change to this module.

Batching is the server's: requests join ``GRBatcher`` queues (one per beam width) and leave them as batches by
token capacity and request cap (``SchedulerConfig``); each batch runs through the engine's own batch execution
(``RetrievalEngine.run_batch``: the runner the server uses, the device fast path where configured), up to
``--max-inflight-batches`` at once on executor threads as on the server, while the calling thread converts the next
inputs. Batches are formed by the inputs and never by the clock (no waiting quota, no idle dispatch), so the batches
— and hence the results — depend only on the inputs and their order: deterministic. Memory is bounded: at most ``window`` inputs
are read ahead of the oldest unfinished one; results come back in input order (``stream`` yields them one by one).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from grserve.config import (
    BeamApiConfig,
    CatalogConfig,
    ModelConfig,
    PrefixCacheConfig,
    SchedulerConfig,
    SearchConfig,
    ServeConfig,
    ServerConfig,
)
from grserve.engine.types import json_score


class RecommendInputError(ValueError):
    """An input the server would refuse; ``index`` is its position in the inputs, ``field`` the offending field."""

    def __init__(self, index: int, message: str, field: str | None = None, kind: str = "invalid_value"):
        super().__init__(f"input {index}: {message}")
        self.index, self.message, self.field, self.kind = index, message, field, kind


@dataclass(frozen=True)
class RecommendedItem:
    item_id: int
    sid: tuple[int, ...]
    score: float  # summed log-probability of the SID tokens (the configured scoring)


@dataclass(frozen=True)
class Recommendation:
    request_id: str
    items: list[RecommendedItem]  # best first
    source: str = "model"  # "popularity": an empty history, answered from the popularity order (cold start)
    history_dropped: int = 0  # oldest history entries cut by truncate "left"
    thinking: str | None = None  # max_think_tokens > 0: the text the model wrote before its first SID token
    user_id: Any = None  # the input's ``user_id``, echoed (offline only: any JSON value)
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (``prefix_cache_tokens``), not computed

    @property
    def item_ids(self) -> list[int]:
        return [it.item_id for it in self.items]

    def to_dict(self) -> dict:
        """The items as ``/v1/recommend`` answers them (a non-finite score as -1e30)."""
        out = {"request_id": self.request_id,
               "items": [{"item_id": it.item_id, "sid": list(it.sid),
                          "score": json_score(it.score)} for it in self.items],
               "source": self.source, "history_dropped": self.history_dropped, "thinking": self.thinking}
        return out if self.user_id is None else {"user_id": self.user_id, **out}


_FLAT = {"model": (ModelConfig, "source"), "dtype": (ModelConfig, "dtype"), "device": (ModelConfig, "device"),
         "seed": (ModelConfig, "seed"), "quantization": (ModelConfig, "quantization"),
         "catalog": (CatalogConfig, "path")}


def serve_config(**kwargs: Any) -> ServeConfig:
    """A ``ServeConfig`` from flat keyword arguments named like ``grserve serve``'s flags (``model``, ``catalog``,
    ``beam_width``, ``scoring``, ``token_capacity``, ``max_prompt_tokens``, ...); checked like the flags."""
    parts: dict[type, dict] = {ModelConfig: {}, CatalogConfig: {}, SearchConfig: {}, SchedulerConfig: {},
                               ServerConfig: {}, BeamApiConfig: {}, PrefixCacheConfig: {}}
    names = {f.name: cls for cls in (SearchConfig, SchedulerConfig, ServerConfig, CatalogConfig, BeamApiConfig,
                                     PrefixCacheConfig)
             for f in fields(cls)}
    for key, value in kwargs.items():
        if key in _FLAT:
            cls, name = _FLAT[key]
            parts[cls][name] = value
        elif key in names:
            parts[names[key]][key] = value
        else:
            raise TypeError(f"unknown setting {key!r} (settings are grserve serve's flags, e.g. model, catalog, "
                            f"beam_width, scoring, token_capacity)")
    search = parts[SearchConfig]
    if "beam_width" in search:
        search.setdefault("max_beam_width", max(SearchConfig().max_beam_width, int(search["beam_width"])))
    return ServeConfig(model=ModelConfig(**parts[ModelConfig]), catalog=CatalogConfig(**parts[CatalogConfig]),
                       search=SearchConfig(**search), scheduler=SchedulerConfig(**parts[SchedulerConfig]),
                       server=ServerConfig(**parts[ServerConfig]), beams=BeamApiConfig(**parts[BeamApiConfig]),
                       prefix=PrefixCacheConfig(**parts[PrefixCacheConfig]))


class Recommender:
    """A GR model + catalog + the retrieval engine, for offline use. ``recommend`` / ``stream`` run requests."""

    def __init__(self, config: ServeConfig | None = None, **kwargs: Any):
        if config is not None and kwargs:
            raise TypeError("give a ServeConfig or keyword settings, not both")
        from grserve.engine.retrieval_engine import RetrievalEngine

        from grserve.catalog.popularity import Popularity
        from grserve.inputs.sid_prompts import BeamContext

        self.config = config if config is not None else serve_config(**kwargs)
        self.engine = RetrievalEngine.build(self.config)
        pop = self.config.catalog.popularity
        self.popularity = Popularity.load(pop) if pop else Popularity()  # the cold-start order, as the server's
        # what the server's conversion needs besides the engine (thinking's limit, the tokenizer); no HTTP metrics
        self._beams = BeamContext(self.engine, self.config.server, self.config.beams, "grserve", None)
        from grserve.inputs.retrieval import recommend_precheck, text_limits

        # the server's cheap checks of a raw body (history lengths: --max-history-entries, 413 with truncate none;
        # exclude_items / include_items counts; a text prompt's characters)
        self._precheck = recommend_precheck(self.engine, self.config.server,
                                            text_limits(self.engine, self.config.server, self.config.beams))

    @classmethod
    def from_config(cls, config: ServeConfig) -> "Recommender":
        return cls(config)

    @property
    def catalog(self):
        return self.engine.catalogs.current()

    @property
    def dtype_choice(self):
        """The dtype the model runs in and why (``model/dtype_choice.py``: ``--dtype auto`` resolved)."""
        return getattr(self.engine.model, "dtype_choice", None)

    def close(self) -> None:
        self.engine.runner.close()

    def __enter__(self) -> "Recommender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def recommend(self, requests: Iterable[Any], *, top_n: int | None = None, beam_width: int | None = None,
                  progress: bool = True) -> list[Recommendation]:
        """Every input's recommendations, in input order (``RecommendInputError`` on the first bad input)."""
        return list(self.stream(requests, top_n=top_n, beam_width=beam_width, progress=progress))

    def stream(self, requests: Iterable[Any], *, top_n: int | None = None, beam_width: int | None = None,
               progress: bool = True, window: int | None = None, total: int | None = None,
               on_error: Any = None) -> Iterator[Recommendation]:
        """Yield each input's recommendations in input order, reading at most ``window`` inputs ahead.

        ``top_n`` / ``beam_width``: defaults for inputs that do not give their own (``top_n`` default 10, as the
        server's). ``on_error(index, error)``: called for a bad input, which is then skipped (no result); without
        it a bad input raises ``RecommendInputError``.
        """
        from grserve.offline_batching import OfflineBatches

        defaults = {k: v for k, v in (("top_n", top_n), ("beam_width", beam_width)) if v is not None}
        sched = self.config.scheduler
        window = window or 4 * sched.max_batch_requests
        if total is None and isinstance(requests, Sequence):
            total = len(requests)
        batches = OfflineBatches(sched, self.engine.run_batch, window, inflight=sched.max_inflight_batches)
        dropped_by: dict[int, tuple[int, Any]] = {}  # id(request) -> (history entries truncate cut, user_id)
        with _progress(progress, total) as bar, closing(batches):
            for index, item in enumerate(requests):
                try:
                    req, dropped, user = self._request(item, index, defaults)
                except RecommendInputError as exc:
                    if on_error is None:
                        raise
                    on_error(index, exc)
                    continue
                dropped_by[id(req)] = dropped, user
                if _cold(req):  # a new user: the popularity order, as the server answers it
                    from grserve.inputs.history import cold_start

                    done = batches.add_result(req, cold_start(req, self.catalog, self.popularity))
                else:
                    done = batches.add(req)
                yield from self._done(done, bar, dropped_by)
            yield from self._done(batches.flush(), bar, dropped_by)

    def _done(self, results, bar, dropped_by: dict[int, tuple[int, Any]]) -> Iterator[Recommendation]:
        for req, res in results:
            dropped, user = dropped_by.pop(id(req))
            bar.update(1)
            thinking = None
            if res.thought is not None:
                from grserve.engine.think import text_tokens

                ids = text_tokens(res.thought, self.catalog.layout.sid_begin)
                thinking = self._beams.tokenizer.decode(ids, skip_special_tokens=False)
            yield Recommendation(res.request_id, [RecommendedItem(int(i.item_id), tuple(int(c) for c in i.sid),
                                                                  float(i.score)) for i in res.items],
                                 source="popularity" if _cold(req) else "model", history_dropped=dropped,
                                 thinking=thinking, user_id=user, cached_tokens=int(res.cached_tokens))

    def _request(self, item: Any, index: int, defaults: dict):
        """One input → the engine's request, through the server's own schema and conversion."""
        from pydantic import ValidationError

        from grserve.inputs.refusal import ApiError
        from grserve.inputs.prompt_template import PromptTemplateError
        from grserve.inputs.house_schemas import RecommendRequest

        user = None
        try:
            if isinstance(item, RecommendRequest):
                body = item
                self._precheck(item.model_dump(exclude_none=True))
            else:
                raw = {**defaults, **as_body(item)}
                user = raw.pop("user_id", None)
                self._precheck(raw)
                body = RecommendRequest.model_validate(raw)
            from grserve.inputs.retrieval import retrieval_request

            return (*retrieval_request(body, self.catalog, self.engine, self.config.server, self._beams), user)
        except ValidationError as exc:
            err = _validation_error(exc)
            raise RecommendInputError(index, err.message, err.field, err.type) from None
        except ApiError as exc:
            raise RecommendInputError(index, exc.message, exc.field, exc.type) from None
        except TypeError as exc:
            raise RecommendInputError(index, str(exc), None, "input_type") from None
        except PromptTemplateError as exc:  # --prompt-template failed on this input's history (the server: a 5xx)
            raise RecommendInputError(index, str(exc), body.history_kind, "prompt_template") from None


def as_body(item: Any) -> dict:
    """An input in any accepted form → a ``/v1/recommend`` body (a dict the server's schema validates)."""
    if isinstance(item, dict):
        return item
    if isinstance(item, str):
        if _json_container(item):
            raise TypeError("a str input is a text prompt, and this one is a JSON object or array (a raw JSONL "
                            "line?): pass json.loads(line) instead, or {\"prompt\": text} for such a prompt")
        return {"prompt": item}
    if isinstance(item, np.ndarray):
        return {"history_items": item.tolist()}
    if isinstance(item, Sequence) and item and all(isinstance(m, dict) and "role" in m for m in item):
        return {"messages": list(item)}
    if isinstance(item, Sequence):
        return {"history_items": list(item)}
    raise TypeError(f"an input is a dict, a list of item ids, a prompt or chat messages; got a {type(item).__name__}")


def _json_container(text: str) -> bool:
    """``text`` parses as a JSON object or array."""
    import json

    stripped = text.strip()
    if not stripped or stripped[0] not in "[{":
        return False
    try:
        return isinstance(json.loads(stripped), (dict, list))
    except ValueError:
        return False


def _validation_error(exc):
    from grserve.inputs.refusal import house_validation_error

    return house_validation_error(exc, ("history",))


def _cold(req) -> bool:
    """A history with no prompt token: answered from the popularity order (the server's cold start)."""
    return req.prompt_tokens.size == 0


def _progress(show: bool, total: int | None):
    """The users/s bar on stderr: shown when asked and stderr is a terminal (tqdm's ``disable=None``), so logs and
    pipes get no bar lines."""
    from tqdm import tqdm

    return tqdm(total=total, desc="recommend", unit="user", dynamic_ncols=True, smoothing=0.1,
                disable=None if show else True)

