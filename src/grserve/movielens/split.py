"""The leave-one-out split of MovieLens-100k ratings (``leave_one_out``).

Each user's ratings sorted by timestamp (ties broken by movie id, so the order is deterministic): the last item is
the test target, the second-to-last the validation target, the rest is training history. Every rating counts as
an interaction (implicit feedback); MovieLens-100k users have >= 20 ratings and never rate a movie twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class Split:
    """Leave-one-out by time. Arrays are aligned: user ``users[i]`` has ``train[i]`` (oldest first), then
    ``valid[i]``, then ``test[i]``. Users with fewer than 3 interactions are dropped."""

    users: np.ndarray  # int64 [U]
    train: list[np.ndarray]  # item ids, oldest first
    valid: np.ndarray  # int64 [U]
    test: np.ndarray  # int64 [U]

    def test_history(self, i: int) -> np.ndarray:
        """What the model sees when predicting the test item: training history + the validation item."""
        return np.append(self.train[i], self.valid[i])


def user_sequences(ratings: "pd.DataFrame") -> tuple[np.ndarray, list[np.ndarray]]:
    """(user ids ascending, each user's item ids ordered by timestamp, ties by item id)."""
    df = ratings.sort_values(["user_id", "timestamp", "movie_id"], kind="stable")
    users, starts = np.unique(df["user_id"].to_numpy(np.int64), return_index=True)
    items = df["movie_id"].to_numpy(np.int64)
    bounds = list(starts[1:]) + [len(items)]
    return users, [items[a:b] for a, b in zip(starts, bounds)]


def leave_one_out(ratings: "pd.DataFrame") -> Split:
    users, seqs = user_sequences(ratings)
    keep = [i for i, s in enumerate(seqs) if len(s) >= 3]
    return Split(
        users=users[keep],
        train=[seqs[i][:-2] for i in keep],
        valid=np.array([seqs[i][-2] for i in keep], dtype=np.int64),
        test=np.array([seqs[i][-1] for i in keep], dtype=np.int64),
    )
