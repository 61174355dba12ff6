"""Peer baselines run on the same weights and requests as grserve.

* ``HFConstrainedBeamSearch``: HF transformers ``generate(num_beams=BW, prefix_allowed_tokens_fn=...)`` — the
  reference for output semantics (``hf`` scoring) and the throughput peer. HF expands the prompt per beam.
* ``NaiveCopyBeamSearch``: grserve's own model, but every beam owns a private copy of the prompt KV
  (``BatchedBeamsKVContext``), i.e. what a beam-per-sequence LLM server does. Same selection logic.
"""

from __future__ import annotations

import tempfile

import numpy as np
import torch

from grserve.attention.context import SequenceKVContext
from grserve.catalog import Catalog
from grserve.model import Decoder, save_pretrained
from grserve.search.beam_search import BeamSearch, Hit


class BatchedBeamsKVContext:
    """B independent sequences decoded in lock-step, each with its own private KV (the naive beam baseline).

    Every beam holds a full copy of its prompt KV: ``from_sequence`` expands one prefilled sequence into
    ``copies`` private caches (this is the memory/time cost the shared-prefix design removes). ``reorder``
    gathers caches by parent index after a beam-selection step.
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        self.k = k  # per layer [B, T, Hkv, D]
        self.v = v

    @classmethod
    def from_sequence(cls, seq: SequenceKVContext, copies: int) -> "BatchedBeamsKVContext":
        ks = [t.unsqueeze(0).repeat(copies, 1, 1, 1) for t in seq.k]  # real copies, not views
        vs = [t.unsqueeze(0).repeat(copies, 1, 1, 1) for t in seq.v]
        return cls(ks, vs)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reorder(self, parents: torch.Tensor) -> None:
        self.k = [t.index_select(0, parents) for t in self.k]
        self.v = [t.index_select(0, parents) for t in self.v]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # one new token per sequence: q [B, Hq, D], k/v [B, Hkv, D]
        self.k[layer] = torch.cat([self.k[layer], k[:, None]], dim=1)
        self.v[layer] = torch.cat([self.v[layer], v[:, None]], dim=1)
        kk, vv = self.k[layer], self.v[layer]  # [B, T, Hkv, D]
        b, hq, d = q.shape
        hkv = kk.shape[2]
        qg = q.view(b, hkv, hq // hkv, d)
        scores = torch.einsum("bhgd,bthd->bhgt", qg, kk) * (d**-0.5)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgt,bthd->bhgd", probs, vv)
        return out.reshape(b, hq, d)


class HFConstrainedBeamSearch:
    def __init__(self, model: Decoder):
        from transformers import AutoModelForCausalLM

        with tempfile.TemporaryDirectory() as d:
            save_pretrained(model, d)
            self.hf = AutoModelForCausalLM.from_pretrained(d, dtype=model.dtype, attn_implementation="sdpa")
        self.hf.to(model.device).eval()
        self.device = model.device

    def allowed_fn(self, catalog: Catalog, prompt_len: int):
        """HF's ``prefix_allowed_tokens_fn``: the catalog trie in token-id space (any SID layout)."""
        layout, trie = catalog.layout, catalog.trie
        tables = [layout.code_tokens(level) for level in range(catalog.depth)]

        def allowed(batch_id: int, ids: torch.Tensor) -> list[int]:
            gen = ids[prompt_len:].tolist()
            level, node = len(gen), 0
            for lv, tok in enumerate(gen):
                code = layout.codes_of(lv, np.array([tok]))
                node = int(trie.step(lv, np.array([node]), code)[0])
                if node < 0:
                    return []
            if level >= catalog.depth:
                return []
            return tables[level][trie.children(level, node)].tolist()

        return allowed

    def run(self, prompt: np.ndarray, beam_width: int, top_n: int, catalog: Catalog) -> list[Hit]:
        return [Hit(int(catalog.item_of_sid(sid)), sid, sc) for sid, sc in self.sequences(prompt, beam_width, top_n,
                                                                                           catalog)]

    @torch.inference_mode()
    def sequences(self, prompt: np.ndarray, beam_width: int, top_n: int, catalog: Catalog
                  ) -> list[tuple[tuple[int, ...], float]]:
        """HF's returned hypotheses as (SID, score), best first, finite scores only (items not checked)."""
        ids = torch.from_numpy(prompt.astype(np.int64))[None].to(self.device)
        out = self.hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=beam_width,
            num_return_sequences=min(top_n, beam_width),
            max_new_tokens=catalog.depth,
            min_new_tokens=catalog.depth,
            do_sample=False,
            length_penalty=0.0,  # raw summed log-probs: every hypothesis has the same length anyway
            early_stopping=True,
            prefix_allowed_tokens_fn=self.allowed_fn(catalog, ids.shape[1]),
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
        seqs = out.sequences[:, ids.shape[1] :].cpu().numpy()
        scores = out.sequences_scores.float().cpu().numpy()
        return [(tuple(int(c) for c in catalog.layout.tokens_to_sids(row)[0]), float(sc))
                for row, sc in zip(seqs, scores) if np.isfinite(sc)]


class NaiveCopyBeamSearch:
    """Prefill once, then copy the prompt KV into every beam; beams reorder by gathering whole caches."""

    def __init__(self, model: Decoder):
        self.model = model

    @torch.inference_mode()
    def run(self, prompt: np.ndarray, beam_width: int, top_n: int, catalog: Catalog) -> tuple[list[Hit], int]:
        model, dev = self.model, self.model.device
        n = int(prompt.shape[0])
        seq = SequenceKVContext(model.spec.num_hidden_layers)
        ids = torch.from_numpy(prompt.astype(np.int64)).to(dev)
        h = model(ids, torch.arange(n, device=dev), seq)
        beams = BeamSearch(catalog, 1, beam_width, None, "vectorized", dev)
        beams.logits[0].copy_(model.logits(h[-1:], beams.heads.rows[0]))
        beams.select_first()
        ctx = BatchedBeamsKVContext.from_sequence(seq, beam_width)  # BW private copies of the prompt KV
        peak = 0
        for level in range(1, catalog.depth):
            beams.prepare_mask(level)
            pos = torch.full((beam_width,), n + level - 1, device=dev)
            h = model(beams.next_tokens, pos, ctx)
            beams.logits[level].copy_(model.logits(h, beams.heads.rows[level]))
            peak = max(peak, ctx.nbytes())
            parents = beams.select(level)
            ctx.reorder(parents)
        return beams.results([top_n])[0], peak
