"""Train a small Qwen3-shaped GR decoder on user histories (next-item SIDs), on CPU, for a fixed number of epochs.

The served layout is the training layout. A user's history is laid out as SID tokens, item after item
(``catalog.layout.sids_to_tokens``), and the model is trained as a plain causal LM over that stream: the token at
position t predicts the token at t+1. So the last prompt position predicts the first SID token of the next item,
and each SID token predicts the next one — exactly what the served beam search decodes (prefill → level 0,
decode → levels 1..D-1). Every position of a history is a training target, not only the last item (SASRec-style
autoregressive training), which is what makes ~1k users enough.

What is trained is grserve's own ``Decoder`` (the module the engine serves), through ``CausalBatchContext``:
right-padded [B, T] sequences flattened to the packed [B·T] layout the decoder takes, causal SDPA per row. Padding
sits after every real token, so no real token ever attends to it; its targets are ignored. The result is saved
with ``grserve.model.save_pretrained`` (config.json + model.safetensors, HF tensor names; HF transformers loads it
as ``Qwen3ForCausalLM``), plus ``train_meta.json`` (settings, catalog SHA-256, timings, losses).

Histories longer than ``max_items`` are cut into windows of ``max_items`` items from the most recent backwards;
serving uses the same ``max_items`` most recent items as the prompt. Each epoch ends with the validation loss
(NLL of the held-out next item's SID given the history); the weights of the best epoch are kept. Training runs
``epochs`` epochs, so the trained weights (and the recall they give) do not depend on how loaded the machine is;
an optional wall-clock ``time_budget_s`` (default: none) stops it earlier, checked every step.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from grserve.catalog import Catalog
from grserve.model.decoder import Decoder
from grserve.model.loader import save_pretrained
from grserve.model.spec import ModelSpec
from grserve.movielens.data import file_sha256

IGNORE = -100


@dataclass(frozen=True)
class TrainConfig:
    # model shape (Qwen3: q/k-norm, GQA, tied embeddings)
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    # data
    max_items: int = 50  # history window in items (prompt = max_items × depth tokens)
    # optimisation
    epochs: int = 12  # validation NLL bottoms out around epoch 10 (best epoch kept)
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    time_budget_s: float | None = None  # optional wall-clock stop (checked every step); None: ``epochs`` only
    # torch intra-op threads while training (None: keep the current setting). 1 by default: on a shared 2-core
    # machine two OpenMP threads that spin-wait for each other were measured 4× slower than one thread.
    threads: int | None = 1

    def settings(self) -> dict:
        """What determines the trained weights (the budget and thread count only decide when/how fast)."""
        d = asdict(self)
        d.pop("time_budget_s")
        d.pop("threads")
        return d


@dataclass
class TrainResult:
    model: Decoder
    config: TrainConfig
    steps: int
    epochs_done: float
    seconds: float
    stopped_by_budget: bool
    best_epoch: int
    threads: int = 1  # torch intra-op threads used
    history: list[dict] = field(default_factory=list)  # per epoch: train_loss, valid_loss, seconds


class CausalBatchContext:
    """Attention for training: B right-padded rows of T tokens, flattened to [B·T]; causal within each row."""

    def __init__(self, batch: int, seqlen: int):
        self.b, self.t = batch, seqlen

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t = self.b, self.t
        q4 = q.view(b, t, q.shape[1], q.shape[2]).transpose(1, 2)
        k4 = k.view(b, t, k.shape[1], k.shape[2]).transpose(1, 2)
        v4 = v.view(b, t, v.shape[1], v.shape[2]).transpose(1, 2)
        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(b * t, q.shape[1], q.shape[2])


def model_spec(cfg: TrainConfig, catalog: Catalog) -> ModelSpec:
    """Vocabulary = the SID tokens (token_offset + Σ codebook sizes) rounded up to a multiple of 16."""
    vocab = -(-catalog.layout.num_tokens // 16) * 16
    return ModelSpec(family="qwen3", vocab_size=vocab, hidden_size=cfg.hidden_size,
                     intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                     num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                     head_dim=cfg.head_dim, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                     attention_bias=False, qk_norm=True,
                     max_position_embeddings=max(4096, 2 * cfg.max_items * catalog.depth))


@torch.no_grad()
def init_weights(model: Decoder, seed: int) -> None:
    """GPT-2 style: N(0, 0.02) matrices, residual output projections scaled by 1/sqrt(2·layers), norms = 1."""
    g = torch.Generator().manual_seed(seed)
    scale = 1.0 / math.sqrt(2 * model.spec.num_hidden_layers)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            std = 0.02 * (scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
            p.copy_(torch.randn(p.shape, generator=g) * std)


def history_tokens(items: np.ndarray, catalog: Catalog, max_items: int) -> np.ndarray:
    """The prompt for a history: its ``max_items`` most recent items as SID tokens (int64)."""
    items = np.asarray(items, dtype=np.int64)[-max_items:]
    return catalog.layout.sids_to_tokens(catalog.sids_of_items(items))


def windows(sequences: Sequence[np.ndarray], max_items: int) -> list[np.ndarray]:
    """Cut each item sequence into windows of at most ``max_items`` (most recent first); drop 1-item windows."""
    out = []
    for seq in sequences:
        seq = np.asarray(seq, dtype=np.int64)
        for end in range(len(seq), 1, -max_items):
            w = seq[max(0, end - max_items):end]
            if len(w) >= 2:
                out.append(w)
    return out


def _pad_batch(token_seqs: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded inputs (tokens[:-1]) and targets (tokens[1:], IGNORE on padding), both [B, T]."""
    t = max(len(s) for s in token_seqs) - 1
    inp = np.zeros((len(token_seqs), t), dtype=np.int64)
    tgt = np.full((len(token_seqs), t), IGNORE, dtype=np.int64)
    for i, s in enumerate(token_seqs):
        n = len(s) - 1
        inp[i, :n] = s[:-1]
        tgt[i, :n] = s[1:]
    return torch.from_numpy(inp), torch.from_numpy(tgt)


def _forward_loss(model: Decoder, inp: torch.Tensor, tgt: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    b, t = inp.shape
    positions = torch.arange(t).repeat(b)
    hidden = model(inp.reshape(-1), positions, CausalBatchContext(b, t))
    return F.cross_entropy(model.logits(hidden), tgt.reshape(-1), ignore_index=IGNORE, reduction=reduction)


@torch.no_grad()
def next_item_nll(model: Decoder, histories: Sequence[np.ndarray], targets: np.ndarray, catalog: Catalog,
                  max_items: int, batch_size: int = 64) -> float:
    """Mean NLL (nats, summed over the SID tokens) of each target item given its history (teacher forcing)."""
    total, count = 0.0, 0
    depth = catalog.depth
    for a in range(0, len(targets), batch_size):
        seqs, tails = [], []
        for h, y in zip(histories[a:a + batch_size], targets[a:a + batch_size]):
            s = history_tokens(np.append(np.asarray(h, np.int64)[-max_items:], y), catalog, max_items + 1)
            seqs.append(s)
            tails.append(len(s) - 1)
        inp, tgt = _pad_batch(seqs)
        keep = torch.full_like(tgt, IGNORE)
        for i, end in enumerate(tails):  # only the target item's tokens count
            keep[i, end - depth:end] = tgt[i, end - depth:end]
        nll = _forward_loss(model, inp, keep, reduction="sum")
        total += float(nll)
        count += len(seqs)
    return total / max(count, 1)


def train_gr(sequences: Sequence[np.ndarray], catalog: Catalog, cfg: TrainConfig = TrainConfig(), *,
             valid: tuple[Sequence[np.ndarray], np.ndarray] | None = None, progress: bool = True,
             log: Callable[[str], None] = lambda s: None) -> TrainResult:
    """Train on item-id sequences (oldest first). ``valid`` = (histories, next items) for per-epoch selection."""
    threads_before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(sequences, catalog, cfg, valid, progress, log)
    finally:
        torch.set_num_threads(threads_before)


def _optimizer(model: Decoder, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms and biases)."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98))


def _lr_schedule(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` × lr at ``total_steps``."""

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    return lr_at


def _train(sequences, catalog, cfg, valid, progress, log) -> TrainResult:
    from tqdm import tqdm

    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    spec = model_spec(cfg, catalog)
    model = Decoder(spec, dtype=torch.float32, device="cpu")
    init_weights(model, cfg.seed)
    model.train().requires_grad_(True)

    wins = windows(sequences, cfg.max_items)
    if not wins:
        raise ValueError("no training sequence has 2 or more items")
    tokens = [catalog.layout.sids_to_tokens(catalog.sids_of_items(w)) for w in wins]
    steps_per_epoch = math.ceil(len(tokens) / cfg.batch_size)
    total_steps = steps_per_epoch * cfg.epochs

    opt = _optimizer(model, cfg)
    lr_at = _lr_schedule(cfg, total_steps)
    log(f"model: {spec.num_parameters():,} parameters (hidden {spec.hidden_size}, {spec.num_hidden_layers} layers, "
        f"vocab {spec.vocab_size}); {len(tokens)} windows of <= {cfg.max_items} items, {steps_per_epoch} steps/epoch")
    history: list[dict] = []
    best = (math.inf, -1, None)
    step, stopped = 0, False
    deadline = math.inf if cfg.time_budget_s is None else t_start + cfg.time_budget_s
    bar = tqdm(total=total_steps, desc="train GR", unit="step", disable=not progress, dynamic_ncols=True)
    try:
        for epoch in range(cfg.epochs):
            t_epoch = time.perf_counter()
            order = rng.permutation(len(tokens))
            run_loss, run_n = 0.0, 0
            for a in range(0, len(order), cfg.batch_size):
                if time.perf_counter() > deadline:
                    stopped = True
                    break
                inp, tgt = _pad_batch([tokens[i] for i in order[a:a + cfg.batch_size]])
                for group in opt.param_groups:
                    group["lr"] = lr_at(step)
                loss = _forward_loss(model, inp, tgt)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
                step += 1
                run_loss += loss.item()
                run_n += 1
                bar.update(1)
                bar.set_postfix(epoch=epoch + 1, loss=f"{run_loss / run_n:.3f}")
            entry = {"epoch": epoch + 1, "train_loss": run_loss / max(run_n, 1), "steps": run_n}
            if valid is not None and run_n:
                model.eval()
                entry["valid_nll"] = next_item_nll(model, valid[0], valid[1], catalog, cfg.max_items)
                model.train()
                if entry["valid_nll"] < best[0]:
                    best = (entry["valid_nll"], epoch + 1, {k: v.detach().clone() for k, v in model.state_dict().items()})
                bar.set_postfix(epoch=epoch + 1, loss=f"{entry['train_loss']:.3f}", valid=f"{entry['valid_nll']:.3f}")
            entry["seconds"] = round(time.perf_counter() - t_epoch, 2)
            history.append(entry)
            if stopped:
                break
    finally:
        bar.close()
    if best[2] is not None:
        model.load_state_dict(best[2])
    seconds = time.perf_counter() - t_start
    epochs_done = step / steps_per_epoch
    if stopped:
        log(f"time budget {cfg.time_budget_s:.0f} s reached after {step} steps ({epochs_done:.1f} epochs)")
    return TrainResult(model=model.eval().requires_grad_(False), config=cfg, steps=step, epochs_done=epochs_done,
                       seconds=seconds, stopped_by_budget=stopped, best_epoch=best[1],
                       threads=torch.get_num_threads(), history=history)


def save_trained(result: TrainResult, out: str | Path, *, catalog_path: str | Path | None = None,
                 extra: dict | None = None) -> Path:
    """HF-format directory (config.json + model.safetensors) + train_meta.json."""
    out = Path(out)
    save_pretrained(result.model, out)
    meta = {
        "config": result.config.settings(),
        "time_budget_s": result.config.time_budget_s,
        "steps": result.steps,
        "epochs_done": round(result.epochs_done, 3),
        "best_epoch": result.best_epoch,
        "seconds": round(result.seconds, 1),
        "stopped_by_budget": result.stopped_by_budget,
        "threads": result.threads,
        "torch": torch.__version__,
        "num_parameters": result.model.spec.num_parameters(),
        "history": result.history,
    }
    if catalog_path is not None:
        meta["catalog"] = str(catalog_path)
        meta["catalog_sha256"] = file_sha256(catalog_path)
    meta.update(extra or {})
    (out / "train_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out
