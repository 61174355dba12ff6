"""What the LLM cluster test modules on a real local Ray share (``test_cluster_ray.py``, ``test_cluster_pd.py``).

- ``save_random_model``: a 2-layer ``tiny``-shaped random decoder saved as an HF directory (greedy outputs vary
  with the position; a preset's often repeat one token);
- ``running_cluster``: three instance actors behind a started ``ClusterLLMEngine`` with KV routing, a 6 s
  heartbeat and no restarts (the tests use the instances up: a killed one must stay dead), stopped at the end;
- ``one_engine``: the same requests on one engine in this process (the reference the cluster must equal);
- ``consume``: what a streaming client sees.

Each module keeps its own fixtures (module-scoped) and builds them from these.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import torch

from grserve.cluster.llm.front_end import ClusterLLMEngine
from grserve.config import ClusterConfig, LLMServeConfig

HEARTBEAT_S = 6.0  # a loaded 2-core machine starved healthy instances past 3 s of silence (fenced, then requests lost)


def save_random_model(tmp_path_factory: Any, random_decoder: Any, name: str, seed: int, layers: int = 2) -> str:
    """The ``tiny`` preset's shape with ``layers`` layers and 4096 positions, weights N(0, 0.02²) from ``seed``."""
    from grserve.model.loader import save_pretrained
    from grserve.model.spec import PRESETS

    spec = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=layers, max_position_embeddings=4096)
    path = tmp_path_factory.mktemp(name)
    save_pretrained(random_decoder(spec, seed, 0.02), path)
    return str(path)


@contextlib.contextmanager
def running_cluster(cfg: LLMServeConfig, **cluster: Any) -> Iterator[ClusterLLMEngine]:
    """Three instances, KV routing; ``HEARTBEAT_S`` of silence fences an instance (a loaded CI machine can starve a
    healthy instance's poll for seconds); ``restart_instances=False``: the tests use the instances up.
    ``cluster``: more ``ClusterConfig`` fields."""
    cc = ClusterConfig(**{"instances": 3, "routing": "kv", "heartbeat_timeout_s": HEARTBEAT_S,
                          "restart_instances": False, **cluster})
    eng = ClusterLLMEngine.launch(cfg, cc)
    eng.start()
    try:
        yield eng
    finally:
        eng.stop()


def one_engine(cfg: LLMServeConfig) -> Callable[[list[list[int]], Any], list[list[int]]]:
    """``run(prompts, params)`` → the output ids of each prompt on one engine built from ``cfg`` in this process."""
    from grserve.engine.async_llm import AsyncLLMEngine

    core = AsyncLLMEngine.build(cfg).core

    def run(prompts, sp):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # beside four busy processes on a small machine, more threads only spin
        try:
            return core.generate(prompts, sp)
        finally:
            torch.set_num_threads(threads)

    return run


async def consume(handle: Any) -> list[int]:
    """What a streaming client sees: the token ids of every event, in order."""
    ids: list[int] = []
    async for ev in handle.events():
        ids.extend(ev.token_ids)
    await handle.result()
    return ids
