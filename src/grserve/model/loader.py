"""Build a ``Decoder`` from a preset name (seeded random weights) or an HF-format checkpoint directory."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from grserve.model import dtype_choice
from grserve.model.decoder import Decoder
from grserve.model.dtype_choice import AUTO, DtypeChoice
from grserve.model.spec import PRESETS, ModelSpec

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _preset_list() -> str:
    return ", ".join(sorted(PRESETS))


def _as_dir(source: str | Path) -> Path | None:
    if not str(source).strip():
        return None
    p = Path(source).expanduser()
    return p if p.is_dir() else None


def resolve_spec(source: str | Path) -> ModelSpec:
    """The ModelSpec of a preset name or HF directory, without building weights."""
    if isinstance(source, str) and source in PRESETS:
        return PRESETS[source]
    d = _as_dir(source)
    if d is None:
        raise ValueError(f"unknown model source {str(source)!r}: not a preset ({_preset_list()}) "
                         "and not an existing directory")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"model directory {str(d)!r} has no config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"cannot parse {str(cfg_path)!r}: {e}") from None
    return ModelSpec.from_hf_config(cfg)


# dtype names accepted on command lines and in configs ("auto": model/dtype_choice.py picks one of them)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def resolve_dtype(dtype: torch.dtype | str, device: torch.device | str = "cpu") -> torch.dtype:
    """A torch dtype, its name in ``DTYPES``, or ``"auto"``: what ``model/dtype_choice.py`` picks on ``device``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == AUTO:
        dtype = dtype_choice.resolve(AUTO, device)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)} or {AUTO!r}")
    return DTYPES[dtype]


def load_model(source: str | Path, *, dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
               seed: int = 0, min_vocab: int | None = None, quantization: str = "none") -> Decoder:
    """Preset name → seeded random weights; directory → weights from its safetensors files.

    ``dtype`` is a torch dtype, a name in ``DTYPES`` or ``"auto"`` (``model/dtype_choice.py``); the model's
    ``dtype_choice`` says which dtype was used and why (start lines, benchmarks). ``min_vocab``: a preset's vocabulary is grown to at least
    this (rounded up to a multiple of 64) — a synthetic catalog whose SID tokens do not fit the preset's.
    ``quantization``: ``none`` or a scheme of ``model/quantized_linear.py`` (the projections quantized after the
    weights load; ``QuantizationRefused`` where this machine cannot run it fast)."""
    if quantization != "none":  # refused before any weight is read
        from grserve.model import quantized_linear

        quantized_linear.choose(quantization, device, resolve_dtype(dtype, device))
    spec = resolve_spec(source)
    is_preset = isinstance(source, str) and source in PRESETS
    if is_preset and min_vocab is not None and min_vocab > spec.vocab_size:
        spec = dataclasses.replace(spec, vocab_size=-(-int(min_vocab) // 64) * 64)
    if isinstance(dtype, torch.dtype):
        chosen = DtypeChoice(str(dtype).removeprefix("torch."), "asked for", str(dtype).removeprefix("torch."))
    else:
        chosen = dtype_choice.choice(dtype, str(device))
    model = Decoder(spec, dtype=resolve_dtype(chosen.name), device=device)
    model.dtype_choice = chosen
    if is_preset:
        _random_init(model, seed)
    else:
        _load_safetensors(model, Path(source).expanduser())
    model = model.eval().requires_grad_(False)
    if quantization != "none":
        from grserve.model.quantized_linear import quantize_model

        model.quantized = quantize_model(model, quantization)
    return model


_INIT_CHUNK = 1 << 22


@torch.no_grad()
def _random_init(model: Decoder, seed: int) -> None:
    """normal(0, .02) weights and biases, norm weights 1 + normal(0, .05), sampled in place in the model dtype.

    Every parameter is filled in fixed-size chunks, each from its own generator seeded by (seed, parameter
    index, chunk index): the result does not depend on the thread count, and CPU chunks run in parallel.
    """
    jobs = []
    for pi, (name, p) in enumerate(model.named_parameters()):  # deterministic order; tied weights appear once
        mean, std = (1.0, 0.05) if name.endswith("norm.weight") else (0.0, 0.02)
        flat = p.detach().view(-1)  # detached: worker threads do not inherit no_grad
        for ci, start in enumerate(range(0, flat.numel(), _INIT_CHUNK)):
            chunk_seed = ((seed * 1_000_003 + pi) * 1_000_003 + ci) % (1 << 63)
            jobs.append((flat[start:start + _INIT_CHUNK], mean, std, chunk_seed))

    def fill(job) -> None:
        t, mean, std, chunk_seed = job
        g = torch.Generator(device=t.device)
        g.manual_seed(chunk_seed)
        t.normal_(mean, std, generator=g)

    workers = max(1, torch.get_num_threads()) if model.device.type == "cpu" else 1
    if workers == 1:
        for job in jobs:
            fill(job)
    else:
        with ThreadPoolExecutor(workers) as ex:
            list(ex.map(fill, jobs))


def _shard_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{str(index)!r} has no weight_map")
        files = [d / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"shard file(s) listed in {str(index)!r} not found: {', '.join(missing)}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(d)!r} contains no *.safetensors files")
    return files


@torch.no_grad()
def _load_safetensors(model: Decoder, d: Path) -> None:
    params = dict(model.named_parameters())  # tied lm_head.weight is deduplicated away
    tied = model.spec.tie_word_embeddings
    loaded: set[str] = set()
    unexpected: list[str] = []
    for f in _shard_files(d):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                p = params.get(name)
                if p is None:
                    if (tied and name == "lm_head.weight") or name.endswith(_IGNORED_SUFFIXES):
                        continue
                    unexpected.append(name)
                    continue
                t = sf.get_tensor(name)
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"tensor {name!r} in {str(f)!r} has shape {tuple(t.shape)}, "
                                     f"expected {tuple(p.shape)}")
                p.copy_(t)
                loaded.add(name)
    if unexpected:
        raise ValueError(f"checkpoint {str(d)!r} has tensors this model does not use: {', '.join(unexpected[:10])}"
                         + (" ..." if len(unexpected) > 10 else ""))
    missing = [n for n in params if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint {str(d)!r} is missing tensor(s): {', '.join(missing[:10])}"
                         + (" ..." if len(missing) > 10 else ""))


def save_pretrained(model: Decoder, path: str | Path) -> None:
    """Write config.json + model.safetensors with HF tensor names (lm_head omitted when tied)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters()}
    (out / "config.json").write_text(json.dumps(model.spec.to_hf_config(model.dtype), indent=2) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
