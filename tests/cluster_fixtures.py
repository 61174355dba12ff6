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


def listening_sockets(pids: set[int]) -> list[tuple[int, str, str, int]]:
    """(pid, command, address, port) of every TCP socket in LISTEN state that one of ``pids`` holds (/proc)."""
    import os
    import socket

    listening: dict[str, tuple[str, int]] = {}  # socket inode → (address, port)
    for family, table in ((socket.AF_INET, "/proc/net/tcp"), (socket.AF_INET6, "/proc/net/tcp6")):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] != "0A":  # TCP_LISTEN
                    continue
                addr, port = cols[1].split(":")
                raw = bytes.fromhex(addr)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
                listening[cols[9]] = (socket.inet_ntop(family, raw), int(port, 16))
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            name = open(f"/proc/{pid}/comm").read().strip()
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listening:
                out.append((pid, name, *listening[target[8:-1]]))
    return out


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it (Ray's GCS, raylet, agents and workers are children of the driver)."""
    import os

    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, []))
    return out
