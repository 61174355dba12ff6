"""Model directories shaped like the GR checkpoints the field publishes, built offline (no downloads) with
``tokenizers`` / ``transformers`` and seeded random weights.

- ``grid_catalog``: a small arithmetic-layout catalog, ``n`` seeded random SIDs of depth 3 with 4 codes per level
  (tries with 1..4 children per node), for the engine and recipe tests.
- ``build_onerec_like``: OneRec-style (Qwen3, tied embeddings). The tokenizer adds ``<|im_start|>``, ``<|im_end|>``,
  ``<think>``, ``</think>``, ``<|sid_begin|>``, ``<|sid_end|>`` and the SID tokens ``<s_a_N>``, ``<s_b_N>``,
  ``<s_c_N>`` (N < ``codes``, added level after level, so each level's ids are contiguous); a Qwen-style chat
  template (``enable_thinking=False`` writes the empty think block). The catalog is codes + per-level templates
  in a jsonl header (``sid_token_templates``, ``sid_begin``, ``sid_end``).
- ``build_minionerec_like``: MiniOneRec / LC-Rec style (Qwen2, untied). The tokenizer adds ``<a_N>``, ``<b_N>``,
  ``<c_N>`` in order of first use in the item index (so a level's ids are neither contiguous nor ordered), no chat
  template (an Alpaca instruction prompt, ``INSTRUCTION``). The catalog is the LC-Rec index JSON as is.

Both models are built on a base vocabulary (the presets' byte-level tokenizer), then ``resize_token_embeddings`` for
the added tokens, as real SID checkpoints are; the embedding and head rows are then redrawn N(0, std²) so that no
two SID tokens tie.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BASE_VOCAB = 300
CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
INSTRUCTION = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
               "request.\n\n### Instruction:\nThe user has interacted with items {history} in chronological order. "
               "Can you predict the next possible item that the user may expect?\n\n### Response:\n")
ONEREC_TEMPLATES = ("<s_a_{}>", "<s_b_{}>", "<s_c_{}>")


def sid_grid() -> np.ndarray:
    """All 64 SIDs of depth 3 with 4 codes per level, in lexicographic order: int [64, 3]."""
    return np.array(list(itertools.product(range(4), range(4), range(4))))


def grid_catalog(n: int, seed: int, first_id: int):
    """``n`` of the grid's SIDs drawn without replacement (seeded), kept in SID order, as items ``first_id`` ..
    ``first_id + n - 1``."""
    from grserve.catalog import Catalog

    rows = np.sort(np.random.default_rng(seed).choice(64, n, replace=False))
    return Catalog.from_arrays(np.arange(first_id, first_id + n), sid_grid()[rows], codebook_sizes=(4, 4, 4))


@dataclass(frozen=True)
class GRModelDir:
    path: Path  # the HF model directory (config, weights, tokenizer)
    catalog: Path  # its catalog file
    sids: np.ndarray  # [n, 3] codes of the catalog's items (row i: item id i)
    strings: list[list[str]]  # the items' SID token strings


def _sids(n_items: int, codes: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.arange(codes)] * 3, indexing="ij"), -1).reshape(-1, 3)
    return grid[np.sort(rng.choice(len(grid), n_items, replace=False))][rng.permutation(n_items)]


def _tokenizer(added: list[str], special: list[str], eos: str, template: str | None, out: Path):
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from grserve.engine.tokenizer import preset_tokenizer_json

    tok = Tokenizer.from_str(preset_tokenizer_json(BASE_VOCAB))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token=eos, pad_token="<pad>")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(out)
    return fast


def _model(family: str, vocab: int, tied: bool, seed: int, out: Path, boost: dict[int, float] | None = None) -> None:
    import transformers

    torch.manual_seed(seed)
    kw = dict(vocab_size=BASE_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=tied,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.1)
    cfg = (transformers.Qwen3Config if family == "qwen3" else transformers.Qwen2Config)(**kw)
    hf = (transformers.Qwen3ForCausalLM if family == "qwen3" else transformers.Qwen2ForCausalLM)(cfg).float().eval()
    hf.resize_token_embeddings(vocab, pad_to_multiple_of=16, mean_resizing=False)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        for token, scale in (boost or {}).items():  # a token the model writes more often (its head row scaled)
            hf.lm_head.weight[token] *= scale
    hf.save_pretrained(out)


def build_onerec_like(out: Path, codes: int = 12, n_items: int = 200, seed: int = 0, tied: bool = True,
                      sid_begin_boost: float | None = None) -> GRModelDir:
    """``sid_begin_boost``: ``<|sid_begin|>``'s head row scaled by it (untied models: the model then ends some of its
    thoughts itself, for think-then-recommend)."""
    out.mkdir(parents=True, exist_ok=True)
    sid_tokens = [t.replace("{}", str(c)) for t in ONEREC_TEMPLATES for c in range(codes)]
    special = ["<|im_start|>", "<|im_end|>", "<|sid_begin|>", "<|sid_end|>"]
    tok = _tokenizer(["<think>", "</think>", *sid_tokens], special, "<|im_end|>", CHAT_TEMPLATE, out)
    boost = {tok.convert_tokens_to_ids("<|sid_begin|>"): sid_begin_boost} if sid_begin_boost else None
    _model("qwen3", len(tok), tied, seed, out, boost)
    sids = _sids(n_items, codes, seed)
    catalog = out / "catalog.jsonl"
    header = {"codebook_sizes": [codes] * 3, "sid_token_templates": list(ONEREC_TEMPLATES),
              "sid_begin": "<|sid_begin|>", "sid_end": "<|sid_end|>"}
    catalog.write_text(json.dumps(header) + "\n" + "".join(
        json.dumps({"item_id": i, "sid": [int(c) for c in s]}) + "\n" for i, s in enumerate(sids)))
    strings = [[ONEREC_TEMPLATES[level].replace("{}", str(int(c))) for level, c in enumerate(s)] for s in sids]
    return GRModelDir(out, catalog, sids, strings)


def build_minionerec_like(out: Path, codes: int = 12, n_items: int = 200, seed: int = 1) -> GRModelDir:
    out.mkdir(parents=True, exist_ok=True)
    sids = _sids(n_items, codes, seed)
    strings = [[f"<{'abc'[level]}_{int(c)}>" for level, c in enumerate(s)] for s in sids]
    added = list(dict.fromkeys(t for row in strings for t in row))  # first use: levels interleave, codes unordered
    tok = _tokenizer(added, [], "<eos>", None, out)
    _model("qwen2", len(tok), False, seed, out)
    catalog = out / "index.json"
    catalog.write_text(json.dumps({str(i): row for i, row in enumerate(strings)}))
    return GRModelDir(out, catalog, sids, strings)
