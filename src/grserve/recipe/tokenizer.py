"""The HF tokenizer of a trained GR model: every SID code is an added token, ``<a_N>``, ``<b_N>``, ... per level.

This is the LC-Rec / MiniOneRec convention (the tokenizer-native SID layout of ``docs/serving-gr-models``): an item
is written ``<a_47><b_103><c_234><d_99>`` and each of those strings is exactly one token. The ids are those of the
catalog's arithmetic layout (``token_offset + Σ codebook_sizes[:l] + code``), so the model trained on the layout's
ids serves unchanged either way: through the catalog's arithmetic layout, or through SID token strings resolved
against this tokenizer. Ids below the offset are special tokens (``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then
``<reserved_N>``); ids past the last SID token up to the vocabulary size are ``<reserved_N>`` too.
"""

from __future__ import annotations

import json
from pathlib import Path

from grserve.catalog import Catalog

SPECIAL = ("<pad>", "<eos>", "<unk>")


def level_prefix(level: int) -> str:
    """``a``, ``b``, ..., ``z``, then ``l26``, ``l27``, ... for deeper levels."""
    return chr(ord("a") + level) if level < 26 else f"l{level}"


def sid_token(level: int, code: int) -> str:
    return f"<{level_prefix(level)}_{code}>"


def sid_vocab(catalog: Catalog, vocab_size: int) -> list[str]:
    """The token string of every id, 0..vocab_size-1."""
    layout = catalog.layout
    if layout.num_tokens > vocab_size:
        raise ValueError(f"the SID layout needs {layout.num_tokens} ids, the vocabulary has {vocab_size}")
    names = [SPECIAL[i] if i < len(SPECIAL) else f"<reserved_{i}>" for i in range(layout.token_offset)]
    for level, size in enumerate(layout.codebook_sizes):
        names += [sid_token(level, c) for c in range(size)]
    names += [f"<reserved_{i}>" for i in range(len(names), vocab_size)]
    return names


def save_sid_tokenizer(catalog: Catalog, model_dir: str | Path, vocab_size: int | None = None) -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` into ``model_dir`` (vocab size: its config.json's)."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    model_dir = Path(model_dir)
    if vocab_size is None:
        vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    names = sid_vocab(catalog, vocab_size)
    tok = Tokenizer(WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    # added tokens are matched in raw text before any splitting: "<a_1><b_2>" -> two tokens, no spaces needed
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names[:catalog.layout.token_offset]])
    tok.add_tokens([AddedToken(n, special=False, normalized=False) for n in names[catalog.layout.token_offset:]])
    tok.save(str(model_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "<eos>",
              "unk_token": "<unk>", "model_max_length": 4096, "clean_up_tokenization_spaces": False}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return model_dir
