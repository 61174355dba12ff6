"""The online LightGBM next-access-time predictor (LCR §3.2, §5.1; LRB-style features).

Per key it keeps the last access time, the request count, the ``n_deltas`` most recent inter-access gaps
(most recent first) and ``n_edcs`` exponentially decayed counters, EDC_i ← 1 + EDC_i · 2^(−Δ / 2^(e0+i)), plus one
static feature (token depth for radix nodes, the key for embeddings; 0 by default). Each access writes one
training row (the features right after the access) into a ring of the last ``window`` accesses. The row's label is
the gap to the key's next access, filled when that access arrives; a row older than ``horizon`` ticks without
one is labelled 2·horizon (censored, as LRB does). Every ``retrain_every`` accesses a LightGBM regressor is
refitted on log1p(label) over (a subsample of) the window. A prediction is the key's last access time + the
predicted gap (so 𝒫 holds next-request *times*, digest §11.4).

Decisions (digest §11.9–11.11): logical time (one tick per request); objective L2 on log1p(gap); 32 trees of 31
leaves, learning rate 0.1; no absolute-timestamp feature (non-stationary); before the first model exists a key
is predicted at last + mean(own gaps) (or last + 2·horizon for keys seen once).

``train_async=True`` refits on a background thread from a snapshot (predictions keep using the previous model
meanwhile); otherwise refits run inline, deterministically.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable, Hashable, Sequence

import numpy as np

from grserve.eviction.config import PredictorConfig

_LN2 = math.log(2.0)


class LearnedPredictor:
    stable = False  # predictions change when the model is refitted

    def __init__(self, cfg: PredictorConfig | None = None,
                 static_feature: Callable[[Hashable], float] | None = None, train_async: bool = False):
        self.cfg = cfg = cfg or PredictorConfig()
        if cfg.window < 2 * cfg.retrain_every and cfg.window < cfg.horizon:
            raise ValueError("window must cover the horizon or two retrain periods")
        self.static_feature = static_feature
        self.train_async = train_async
        self.n_features = cfg.n_deltas + cfg.n_edcs + 2
        self._decay = [1.0 / (2.0 ** (cfg.edc_base_exp + i)) for i in range(cfg.n_edcs)]
        # key -> [last, count, deltas(list, newest first), edcs(list), static, sample_id]
        self._hist: dict[Hashable, list] = {}
        w = cfg.window
        self._X = np.full((w, self.n_features), np.nan, dtype=np.float32)
        self._y = np.full(w, np.nan, dtype=np.float64)
        self._t = np.zeros(w, dtype=np.int64)
        self._n = 0  # rows written
        self._lock = threading.RLock()
        self._rng = np.random.default_rng(cfg.seed)
        self.model = None
        self.default_gap: float | None = None
        self.retrains = 0
        self.train_seconds = 0.0
        self.predict_seconds = 0.0
        self._trainer: threading.Thread | None = None
        self._nan_row = [math.nan] * self.n_features

    # ---- features ------------------------------------------------------------------------------------------
    def _row(self, h: list) -> list[float]:
        d = h[2]
        nd = self.cfg.n_deltas
        deltas = d + [math.nan] * (nd - len(d)) if len(d) < nd else d
        return [*deltas, *h[3], float(h[1]), h[4]]

    def observe(self, key: Hashable, now: int) -> None:
        cfg = self.cfg
        with self._lock:
            h = self._hist.get(key)
            if h is None:
                static = float(self.static_feature(key)) if self.static_feature is not None else 0.0
                h = [now, 1, [], [1.0] * cfg.n_edcs, static, -1]
                self._hist[key] = h
                if len(self._hist) > cfg.max_keys:
                    self._forget_oldest()
            else:
                gap = now - h[0]
                sid = h[5]
                if sid >= 0 and sid >= self._n - cfg.window and gap <= cfg.horizon:
                    self._y[sid % cfg.window] = gap
                d = h[2]
                d.insert(0, float(gap))
                if len(d) > cfg.n_deltas:
                    d.pop()
                e = h[3]
                for i, c in enumerate(self._decay):
                    e[i] = 1.0 + e[i] * math.exp(-gap * c * _LN2)
                h[0] = now
                h[1] += 1
            sid = self._n
            slot = sid % cfg.window
            self._X[slot] = self._row(h)
            self._y[slot] = math.nan
            self._t[slot] = now
            h[5] = sid
            self._n += 1
        if self._n % cfg.retrain_every == 0:
            self._schedule_retrain(now)

    def copy_history(self, src: Hashable, dst: Hashable) -> None:
        with self._lock:
            h = self._hist.get(src)
            if h is not None:
                self._hist[dst] = [h[0], h[1], list(h[2]), list(h[3]), h[4], -1]

    def _forget_oldest(self) -> None:
        keep = sorted(self._hist.items(), key=lambda kv: kv[1][0])[len(self._hist) // 2:]
        self._hist = dict(keep)

    # ---- training ------------------------------------------------------------------------------------------
    def _training_set(self, now: int) -> tuple[np.ndarray, np.ndarray] | None:
        cfg = self.cfg
        with self._lock:
            n = min(self._n, cfg.window)
            X, y, t = self._X[:n].copy(), self._y[:n].copy(), self._t[:n].copy()
        unl = np.isnan(y)
        censored = unl & (now - t >= cfg.horizon)
        y[censored] = 2.0 * cfg.horizon
        ok = ~np.isnan(y)
        X, y = X[ok], y[ok]
        if len(y) < cfg.min_train:
            return None
        if len(y) > cfg.max_train:
            pick = self._rng.choice(len(y), cfg.max_train, replace=False)
            X, y = X[pick], y[pick]
        return X, np.log1p(y)

    def _fit(self, data: tuple[np.ndarray, np.ndarray]) -> None:
        import lightgbm as lgb

        cfg = self.cfg
        t0 = time.perf_counter()
        params = dict(objective="regression", num_leaves=cfg.num_leaves, learning_rate=cfg.learning_rate,
                      num_threads=cfg.num_threads, verbose=-1, seed=cfg.seed, deterministic=True,
                      min_data_in_leaf=20, force_row_wise=True)
        X, y = data
        booster = lgb.train(params, lgb.Dataset(X, y, free_raw_data=True), num_boost_round=cfg.num_rounds)
        self.model = booster  # atomic swap: concurrent predictions use the old or the new model
        self.default_gap = float(np.expm1(y.mean()))
        self.retrains += 1
        self.train_seconds += time.perf_counter() - t0

    def _schedule_retrain(self, now: int) -> None:
        if self.train_async:
            if self._trainer is not None and self._trainer.is_alive():
                return  # previous refit still running: skip this one
            data = self._training_set(now)
            if data is None:
                return
            self._trainer = threading.Thread(target=self._fit, args=(data,), daemon=True, name="lcr-train")
            self._trainer.start()
        else:
            data = self._training_set(now)
            if data is not None:
                self._fit(data)

    def wait_training(self, timeout: float = 30.0) -> None:
        if self._trainer is not None:
            self._trainer.join(timeout)

    # ---- prediction ----------------------------------------------------------------------------------------
    def predict(self, keys: Sequence[Hashable], now: int) -> list[float]:
        t0 = time.perf_counter()
        with self._lock:
            hs = [self._hist.get(k) for k in keys]
            rows = [self._row(h) if h is not None else self._nan_row for h in hs]
        last = np.array([h[0] if h is not None else now for h in hs], dtype=np.float64)
        model = self.model
        if model is None:
            gaps = np.array([sum(h[2]) / len(h[2]) if h is not None and h[2] else 2.0 * self.cfg.horizon
                             for h in hs])
        else:
            X = np.asarray(rows, dtype=np.float32)
            gaps = np.expm1(model.predict(X, num_threads=self.cfg.num_threads))
        self.predict_seconds += time.perf_counter() - t0
        return (last + gaps).tolist()
