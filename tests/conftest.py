"""Shared fixtures: the small models several test files build.

Each fixture is session-scoped and returns a factory; a factory builds one model per argument set, seeded, and
hands the same object to every test that asks for the same arguments. The models are read-only: a test must not
change their weights, dtype or device (build its own model for that).

- ``tiny_model(seed)``: the ``tiny`` preset with seeded random weights (``load_model("tiny", seed=seed)``);
- ``random_decoder(spec, seed, std)``: a ``Decoder`` of any shape with every parameter drawn from N(0, std²)
  after ``torch.manual_seed(seed)`` (weights far from a preset's, so paths that must agree are tested away
  from ties);
- ``hf_qwen3(kv_heads, seed, perturb_norms)``: a small HF transformers ``Qwen3ForCausalLM`` and the same weights
  loaded by grserve, the pair every "grserve = HF" LLM test compares;
- ``onerec_dir`` / ``minionerec_dir`` / ``thinking_onerec_dir``: GR model directories shaped like the published
  checkpoints (SIDs as added tokens of their tokenizer, a catalog file beside them; ``tests/gr_fixtures.py``). Not
  factories: one each.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
import time
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU tensors only under the interpreter, which must be on before any @triton.jit function is
# defined (grserve imports its kernel sources lazily, so setting it here is early enough). Never on a CUDA machine.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def declared_commands() -> dict[str, EntryPoint]:
    """The ``grserve.commands`` entry points that pyproject.toml declares: what installing this tree registers."""
    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["project"]["entry-points"]["grserve.commands"]
    return {name: EntryPoint(name, value, "grserve.commands") for name, value in declared.items()}


def _use_declared_commands() -> None:
    """The tests run this source tree; an install made from an older tree (an editable install made before the lab
    package existed) lacks its entry points, so the command line the tests drive loads the declared ones. A fresh
    ``make install`` registers them itself (tests/grserve/test_cli.py checks both)."""
    from grserve import cli

    declared = declared_commands()
    installed = cli.installed_commands
    if set(installed()) != set(declared):
        cli.installed_commands = functools.wraps(installed)(lambda: {name: ep.load() for name, ep in declared.items()})


_use_declared_commands()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped cleanly where no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def forced_cpu_isa(monkeypatch):
    """``forced_cpu_isa("avx2")`` re-detects the CPU fast paths under ``GRSERVE_CPU_ISA`` (None: unset);
    the detection of the running process is restored afterwards (``model/cpu_support.py``)."""
    from grserve.model import cpu_support as cs

    def force(level: str | None):
        if level is None:
            monkeypatch.delenv(cs.ENV, raising=False)
        else:
            monkeypatch.setenv(cs.ENV, level)
        return cs.refresh()

    yield force
    monkeypatch.undo()
    cs.refresh()


@pytest.fixture
def one_thread():
    """One torch intra-op thread for the test (tiny GEMMs: two OpenMP threads on a shared, busy 2-core box are
    100× slower; and the one-thread paths, e.g. a serial decode kernel)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_model():
    """``tiny_model(seed=0)`` → the ``tiny`` preset (fp32, CPU) with seeded random weights."""
    from grserve.model import load_model

    return functools.cache(lambda seed=0: load_model("tiny", seed=seed))


@pytest.fixture(scope="session")
def random_decoder():
    """``random_decoder(spec, seed, std)`` → ``Decoder(spec)`` (fp32, CPU, eval, no grad), every parameter
    N(0, std²) drawn in ``parameters()`` order after ``torch.manual_seed(seed)``."""
    from grserve.model import Decoder

    @functools.cache
    def build(spec, seed: int, std: float):
        model = Decoder(spec).eval().requires_grad_(False)
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, std)
        return model

    return build


@pytest.fixture(scope="session")
def hf_qwen3(tmp_path_factory):
    """``hf_qwen3(kv_heads, seed, perturb_norms=False)`` → (hf, ours).

    hf: ``Qwen3ForCausalLM`` (fp32, eager attention; vocab 300, hidden 64, intermediate 128, 2 layers, 4 query
    heads of 16, ``kv_heads`` K/V heads, untied, init std 0.1) built after ``torch.manual_seed(seed)``; with
    ``perturb_norms`` every norm weight is then 1 + 0.2·N(0, 1), so that each norm matters. ours: the same
    weights saved by HF and loaded by ``grserve.model.load_model``."""
    transformers = pytest.importorskip("transformers")
    from grserve.model import load_model

    @functools.cache
    def build(kv_heads: int, seed: int, perturb_norms: bool = False):
        torch.manual_seed(seed)
        cfg = transformers.Qwen3Config(
            vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
            initializer_range=0.1)
        cfg._attn_implementation = "eager"
        hf = transformers.Qwen3ForCausalLM(cfg).float().eval()
        if perturb_norms:
            with torch.no_grad():
                for name, p in hf.named_parameters():
                    if name.endswith("norm.weight"):
                        p.copy_(1.0 + 0.2 * torch.randn_like(p))
        d = tmp_path_factory.mktemp(f"hf-qwen3-kv{kv_heads}-seed{seed}")
        hf.save_pretrained(d)
        return hf, load_model(str(d))

    return build


@contextlib.contextmanager
def live_server(app, log_level: str = "error"):
    """``app`` served by uvicorn on a free loopback port in a daemon thread; yields its base URL, then stops it."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        th.join(timeout=5)


@pytest.fixture(scope="session")
def onerec_dir(tmp_path_factory):
    """A OneRec-like model directory (``tests/gr_fixtures.py``): Qwen3, ``<s_a_N>`` SID tokens, a chat template."""
    pytest.importorskip("transformers")
    from gr_fixtures import build_onerec_like

    return build_onerec_like(tmp_path_factory.mktemp("onerec-like"))


@pytest.fixture(scope="session")
def minionerec_dir(tmp_path_factory):
    """A MiniOneRec-like model directory (``tests/gr_fixtures.py``): Qwen2, ``<a_N>`` SID tokens, an index JSON."""
    pytest.importorskip("transformers")
    from gr_fixtures import build_minionerec_like

    return build_minionerec_like(tmp_path_factory.mktemp("minionerec-like"))


@pytest.fixture(scope="session")
def thinking_onerec_dir(tmp_path_factory):
    """A OneRec-like model directory that thinks: untied, ``<|sid_begin|>``'s head row doubled, so its greedy text
    ends in sid_begin by itself after some prompts and runs to the limit after others."""
    pytest.importorskip("transformers")
    from gr_fixtures import build_onerec_like

    return build_onerec_like(tmp_path_factory.mktemp("onerec-thinking"), tied=False, sid_begin_boost=2.0)
