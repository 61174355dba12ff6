"""Train a small Qwen3-shaped GR decoder on user histories (next-item SIDs), on CPU, for a fixed number of epochs.

The served layout is the training layout. A user's history is laid out as SID tokens, item after item
(``catalog.layout.sids_to_tokens``), and the model is trained as a plain causal LM over that stream: the token at
position t predicts the token at t+1. So the last prompt position predicts the first SID token of the next item,
and each SID token predicts the next one — exactly what the served beam search decodes (prefill → level 0,
decode → levels 1..D-1). Every position of a history is a training target, not only the last item (SASRec-style
autoregressive training), which is what makes ~1k users enough.

What is trained is grserve's own ``Decoder`` (the module the engine serves). Without dropout it runs through
``CausalBatchContext`` (right-padded [B, T] sequences flattened to the packed [B·T] layout the decoder takes,
causal SDPA per row); with dropout through ``recipe.forward.train_forward`` (the same computation plus dropout).
Padding sits after every real token, so no real token ever attends to it; its targets are ignored. The loss is a
cross-entropy normalised over the whole vocabulary, the target's SID level, or the codes the catalog allows after
the target's prefix (``recipe.losses``). The result is saved with ``grserve.model.save_pretrained``
(config.json + model.safetensors, HF tensor names; HF transformers loads it as ``Qwen3ForCausalLM``), plus
``train_meta.json`` (settings, catalog SHA-256, timings, losses).

Histories are cut into windows of ``window_items`` items (default ``max_items``), from the most recent end
backwards, every ``window_stride`` items (default: the window, i.e. no overlap); serving uses the ``max_items``
most recent items as the prompt. Batches are drawn in random order; with ``length_buckets`` the windows of a
batch have similar lengths (less padding: shuffled, then sorted by length within groups of 50 batches). Each
epoch ends with the validation loss (NLL of the held-out next item's SID given the history, under the training
loss's normalisation); the weights of the best epoch are kept, or with ``keep="last"`` the last epoch's (a
ranking model can keep improving its top items while its NLL, which also pays for confident misses, rises). With
``ema_decay`` the weights validated and kept are the moving average of the weights (``recipe.ema``). Training
runs ``epochs`` epochs, so the trained weights do not depend on how loaded the machine is; an optional wall-clock
``time_budget_s`` (default: none) stops it earlier, checked every step.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from grserve.catalog import Catalog
from grserve.model.decoder import Decoder
from grserve.model.loader import save_pretrained
from grserve.model.spec import ModelSpec
from grserve.model.thread_choice import torch_threads
from grserve.recipe.files import file_sha256
from grserve.recipe.forward import train_forward
from grserve.recipe.config import TrainConfig
from grserve.recipe.ema import WeightAverage
from grserve.recipe.losses import IGNORE, SidTargets, next_token_loss


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
                     head_dim=cfg.head_dim, rms_norm_eps=1e-6, rope_theta=10000.0,
                     tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=False, qk_norm=True,
                     max_position_embeddings=max(4096, 2 * max(cfg.max_items, cfg.window) * catalog.depth))


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


def windows(sequences: Sequence[np.ndarray], max_items: int, stride: int | None = None) -> list[np.ndarray]:
    """Cut each item sequence into windows of at most ``max_items``, ending every ``stride`` items from the most
    recent end (default: ``max_items``, no overlap) until a window reaches the start; drop 1-item windows."""
    stride = stride or max_items
    out = []
    for seq in sequences:
        seq = np.asarray(seq, dtype=np.int64)
        end = len(seq)
        while end >= 2:
            out.append(seq[max(0, end - max_items):end])
            if end <= max_items:
                break
            end -= stride
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


def _pad_nodes(node_seqs: list[np.ndarray] | None) -> torch.Tensor | None:
    """The trie node above each target (node_seqs[i][1:]), right-padded with 0 like ``_pad_batch``."""
    if node_seqs is None:
        return None
    t = max(len(s) for s in node_seqs) - 1
    out = np.zeros((len(node_seqs), t), dtype=np.int64)
    for i, s in enumerate(node_seqs):
        out[i, :len(s) - 1] = s[1:]
    return torch.from_numpy(out)


class _Stream:
    """The training windows as SID token streams, with the trie node above each token when the loss needs it."""

    def __init__(self, windows_: list[np.ndarray], catalog: Catalog, cfg: TrainConfig):
        self.tokens = [catalog.layout.sids_to_tokens(catalog.sids_of_items(w)) for w in windows_]
        self.sid = SidTargets(catalog) if cfg.loss != "full" else None
        self.nodes = [self.sid.token_nodes(w) for w in windows_] if cfg.loss == "catalog" else None
        self.lengths = np.array([len(t) for t in self.tokens])

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        inp, tgt = _pad_batch([self.tokens[i] for i in rows])
        return inp, tgt, _pad_nodes(None if self.nodes is None else [self.nodes[i] for i in rows])


def _loss(model: Decoder, cfg: TrainConfig, inp: torch.Tensor, tgt: torch.Tensor, nodes: torch.Tensor | None,
          sid: SidTargets | None, reduction: str = "mean", smoothing: float = 0.0) -> torch.Tensor:
    b, t = inp.shape
    if model.training and (cfg.dropout > 0 or cfg.attention_dropout > 0):
        hidden = train_forward(model, inp, cfg.dropout, cfg.attention_dropout)
    else:
        hidden = model(inp.reshape(-1), torch.arange(t).repeat(b), CausalBatchContext(b, t))
    return next_token_loss(model, hidden, tgt.reshape(-1), None if nodes is None else nodes.reshape(-1), cfg.loss,
                           sid, smoothing, reduction)


def _forward_loss(model: Decoder, inp: torch.Tensor, tgt: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Full-vocabulary cross-entropy of a padded batch (no dropout)."""
    return _loss(model, TrainConfig(), inp, tgt, None, None, reduction)


@torch.no_grad()
def next_item_nll(model: Decoder, histories: Sequence[np.ndarray], targets: np.ndarray, catalog: Catalog,
                  max_items: int, batch_size: int = 64, cfg: TrainConfig | None = None,
                  sid: SidTargets | None = None) -> float:
    """Mean NLL (nats, summed over the SID tokens) of each target item given its history (teacher forcing),
    normalised like ``cfg.loss`` (default: over the whole vocabulary)."""
    cfg = cfg or TrainConfig()
    if cfg.loss != "full" and sid is None:
        sid = SidTargets(catalog)
    total, count = 0.0, 0
    depth = catalog.depth
    for a in range(0, len(targets), batch_size):
        wins = [np.append(np.asarray(h, np.int64)[-max_items:], y)
                for h, y in zip(histories[a:a + batch_size], targets[a:a + batch_size])]
        seqs = [catalog.layout.sids_to_tokens(catalog.sids_of_items(w)) for w in wins]
        inp, tgt = _pad_batch(seqs)
        keep = torch.full_like(tgt, IGNORE)
        for i, s in enumerate(seqs):  # only the target item's tokens count
            end = len(s) - 1
            keep[i, end - depth:end] = tgt[i, end - depth:end]
        nodes = _pad_nodes([sid.token_nodes(w) for w in wins]) if cfg.loss == "catalog" else None
        total += float(_loss(model, cfg, inp, keep, nodes, sid, reduction="sum"))
        count += len(seqs)
    return total / max(count, 1)


def train_gr(sequences: Sequence[np.ndarray], catalog: Catalog, cfg: TrainConfig = TrainConfig(), *,
             valid: tuple[Sequence[np.ndarray], np.ndarray] | None = None, progress: bool = True,
             log: Callable[[str], None] = lambda s: None,
             on_epoch: Callable[[Decoder, dict], None] | None = None,
             checkpoint: str | Path | None = None, resume: bool = False) -> TrainResult:
    """Train on item-id sequences (oldest first). ``valid`` = (histories, next items) for per-epoch selection.
    ``on_epoch(model, entry)`` after each epoch sees the weights that epoch would keep (the average with
    ``ema_decay``), in eval mode.

    ``checkpoint``: a file written after every epoch (weights, optimizer, weight average, random states, the best
    epoch so far); with ``resume`` a checkpoint there of the same settings and data is continued from its epoch, and
    the result is the one an uninterrupted run gives (the same batches, dropout masks and schedule)."""
    with torch_threads(cfg.threads):
        return _train(sequences, catalog, cfg, valid, progress, log, on_epoch,
                      None if checkpoint is None else Path(checkpoint), resume)


def _data_key(cfg: TrainConfig, data: "_Stream") -> dict:
    """What a checkpoint must match to be continued: the settings and the training windows' tokens."""
    h = hashlib.sha256()
    for t in data.tokens:
        h.update(np.asarray(t, dtype=np.int64).tobytes())
        h.update(b"|")
    return {"settings": cfg.settings(), "windows_sha256": h.hexdigest()}


def _save_checkpoint(path: Path, key: dict, epoch: int, step: int, model: Decoder, opt, ema, rng, history, best):
    state = {"key": key, "epoch": epoch, "step": step, "model": model.state_dict(), "opt": opt.state_dict(),
             "ema": None if ema is None else {"shadow": ema.shadow, "updates": ema.updates}, "numpy_rng": rng.bit_generator.state,
             "torch_rng": torch.get_rng_state(), "history": history, "best": best}
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: a run killed while saving leaves the previous epoch's checkpoint


def _load_checkpoint(path: Path, key: dict, log: Callable[[str], None]) -> dict | None:
    if not path.is_file():
        log(f"no checkpoint at {path}; training from the start")
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("key") != key:
        log(f"checkpoint {path} is of other settings or data; training from the start")
        return None
    return state


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


def _epoch_batches(lengths: np.ndarray, cfg: TrainConfig, rng: np.random.Generator) -> list[np.ndarray]:
    """One epoch's batches of window indices: a random order, or with ``length_buckets`` random groups of 50
    batches sorted by length within the group, the batches then shuffled."""
    order = rng.permutation(len(lengths))
    if not cfg.length_buckets:
        return [order[a:a + cfg.batch_size] for a in range(0, len(order), cfg.batch_size)]
    group = cfg.batch_size * 50
    out = []
    for g in range(0, len(order), group):
        part = order[g:g + group]
        part = part[np.argsort(lengths[part], kind="stable")]
        out += [part[a:a + cfg.batch_size] for a in range(0, len(part), cfg.batch_size)]
    return [out[i] for i in rng.permutation(len(out))]


def _steps_per_epoch(n: int, cfg: TrainConfig) -> int:
    if not cfg.length_buckets:
        return math.ceil(n / cfg.batch_size)
    group = cfg.batch_size * 50
    return sum(math.ceil(min(group, n - g) / cfg.batch_size) for g in range(0, n, group))


def _new_model(cfg: TrainConfig, catalog: Catalog) -> Decoder:
    torch.manual_seed(cfg.seed)
    model = Decoder(model_spec(cfg, catalog), dtype=torch.float32, device="cpu")
    init_weights(model, cfg.seed)
    return model.train().requires_grad_(True)


def _train(sequences, catalog, cfg, valid, progress, log, on_epoch=None, checkpoint: Path | None = None,
           resume: bool = False) -> TrainResult:
    from tqdm import tqdm

    t_start = time.perf_counter()
    rng = np.random.default_rng(cfg.seed)
    model = _new_model(cfg, catalog)
    wins = windows(sequences, cfg.window, cfg.window_stride)
    if not wins:
        raise ValueError("no training sequence has 2 or more items")
    data = _Stream(wins, catalog, cfg)
    steps_per_epoch = _steps_per_epoch(len(data), cfg)
    total_steps = steps_per_epoch * cfg.epochs
    opt = _optimizer(model, cfg)
    lr_at = _lr_schedule(cfg, total_steps)
    ema = WeightAverage(model, cfg.ema_decay) if cfg.ema_decay > 0 else None
    spec = model.spec
    log(f"model: {spec.num_parameters():,} parameters (hidden {spec.hidden_size}, {spec.num_hidden_layers} layers, "
        f"vocab {spec.vocab_size}); {len(data)} windows of <= {cfg.window} items, {steps_per_epoch} steps/epoch")
    history: list[dict] = []
    best: tuple[float, int, dict | None] = (math.inf, -1, None)
    step, stopped, first_epoch = 0, False, 0
    key = _data_key(cfg, data) if checkpoint is not None else None
    state = _load_checkpoint(checkpoint, key, log) if checkpoint is not None and resume else None
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        if ema is not None:
            ema.shadow, ema.updates = state["ema"]["shadow"], state["ema"]["updates"]
        rng.bit_generator.state = state["numpy_rng"]
        torch.set_rng_state(state["torch_rng"])
        first_epoch, step, history, best = state["epoch"], state["step"], state["history"], state["best"]
        log(f"resuming from {checkpoint} after epoch {first_epoch} ({step} steps)")
    deadline = math.inf if cfg.time_budget_s is None else t_start + cfg.time_budget_s
    bar = tqdm(total=total_steps, initial=step, desc="train GR", unit="step", disable=not progress,
               dynamic_ncols=True)
    try:
        for epoch in range(first_epoch, cfg.epochs):
            t_epoch = time.perf_counter()
            run_loss, run_n = 0.0, 0
            for rows in _epoch_batches(data.lengths, cfg, rng):
                if time.perf_counter() > deadline:
                    stopped = True
                    break
                for group in opt.param_groups:
                    group["lr"] = lr_at(step)
                loss = _loss(model, cfg, *data.batch(rows), data.sid, smoothing=cfg.label_smoothing)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
                if ema is not None:
                    ema.update(model)
                step += 1
                run_loss += loss.item()
                run_n += 1
                bar.update(1)
                bar.set_postfix(epoch=epoch + 1, loss=f"{run_loss / run_n:.3f}")
            entry = {"epoch": epoch + 1, "train_loss": run_loss / max(run_n, 1), "steps": run_n}
            if run_n:
                with ema.swapped(model) if ema is not None else nullcontext():
                    best = _end_epoch(model, cfg, catalog, valid, data.sid, entry, best, on_epoch)
                if "valid_nll" in entry:
                    bar.set_postfix(epoch=epoch + 1, loss=f"{entry['train_loss']:.3f}", valid=f"{entry['valid_nll']:.3f}")
            entry["seconds"] = round(time.perf_counter() - t_epoch, 2)
            history.append(entry)
            with bar.external_write_mode():  # the bar is cleared, the line written whole, the bar redrawn below it
                log(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()}))
            if stopped:
                break
            if checkpoint is not None:
                _save_checkpoint(checkpoint, key, epoch + 1, step, model, opt, ema, rng, history, best)
    finally:
        bar.close()
    if best[2] is not None:
        model.load_state_dict(best[2])
    elif ema is not None:
        model.load_state_dict(ema.shadow)
    seconds = time.perf_counter() - t_start
    epochs_done = step / steps_per_epoch
    if stopped:
        log(f"time budget {cfg.time_budget_s:.0f} s reached after {step} steps ({epochs_done:.1f} epochs)")
    return TrainResult(model=model.eval().requires_grad_(False), config=cfg, steps=step, epochs_done=epochs_done,
                       seconds=seconds, stopped_by_budget=stopped, best_epoch=best[1],
                       threads=torch.get_num_threads(), history=history)


def _end_epoch(model: Decoder, cfg: TrainConfig, catalog: Catalog, valid, sid, entry: dict, best: tuple,
               on_epoch) -> tuple:
    """Add the validation NLL to the epoch's entry, call ``on_epoch``; the new best (nll, epoch, weights) if the
    validation NLL improved."""
    model.eval()
    try:
        if valid is not None:
            entry["valid_nll"] = next_item_nll(model, valid[0], valid[1], catalog, cfg.max_items, cfg=cfg, sid=sid)
        if on_epoch is not None:
            on_epoch(model, entry)
    finally:
        model.train()
    nll = entry.get("valid_nll", math.inf)
    if cfg.keep == "last" or (valid is not None and nll < best[0]):
        return nll, entry["epoch"], {k: v.detach().clone() for k, v in model.state_dict().items()}
    return best


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
