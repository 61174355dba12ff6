"""The training settings of a GR decoder (``TrainConfig``), importable without torch (command-line help, caches).

``settings()`` is what determines the trained weights; a cached model records it in ``train_meta.json`` and is
retrained when it differs (``movielens.artifacts.model_is_current``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

LOSSES = ("full", "level", "catalog")  # recipe.losses


@dataclass(frozen=True)
class TrainConfig:
    # model shape (Qwen3: q/k-norm, GQA)
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    tie_word_embeddings: bool = True
    # data
    max_items: int = 50  # served prompt = the max_items most recent items (max_items × depth tokens)
    window_items: int | None = None  # training window in items (None: max_items)
    window_stride: int | None = None  # items between window ends (None: the window, i.e. no overlap)
    length_buckets: bool = False  # batches of similar-length windows (less padding)
    # optimisation
    epochs: int = 12  # validation NLL bottoms out around epoch 10 (best epoch kept)
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    # regularisation and loss
    dropout: float = 0.0  # embeddings and residual branches (recipe.forward)
    attention_dropout: float = 0.0
    loss: str = "full"  # full | level | catalog (recipe.losses)
    label_smoothing: float = 0.0
    ema_decay: float = 0.0  # > 0: validate and keep an exponential moving average of the weights (recipe.ema)
    keep: str = "best"  # best: the epoch of the lowest validation NLL; last: the last epoch's weights
    time_budget_s: float | None = None  # optional wall-clock stop (checked every step); None: ``epochs`` only
    # torch intra-op threads while training (None: keep the current setting). 1 by default: on a shared 2-core
    # machine two OpenMP threads that spin-wait for each other were measured 4× slower than one thread.
    threads: int | None = 1

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss {self.loss!r}: choose one of {', '.join(LOSSES)}")
        if self.keep not in ("best", "last"):
            raise ValueError(f"keep {self.keep!r}: choose best or last")
        if self.window_items is not None and self.window_items < 2:
            raise ValueError(f"window_items {self.window_items} must be >= 2 (a history item and a target)")

    @property
    def window(self) -> int:
        return self.window_items or self.max_items

    def settings(self) -> dict:
        """What determines the trained weights (the budget and thread count only decide when/how fast)."""
        d = asdict(self)
        d.pop("time_budget_s")
        d.pop("threads")
        return d
