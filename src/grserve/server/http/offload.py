"""Heavy request work off the event loop: JSON parsing and validation of large bodies, tokenization, chat-template
rendering. It runs in one small pool of ``HEAVY_WORKERS`` threads shared by every app of the process, so a huge
request costs a worker, never the event loop that answers ``/health`` and every other client; how many requests can
wait for a worker is bounded by admission (``--max-waiting``, ``admission.py``) on the routes that queue work.

The tokenizers' Rust code releases the GIL while it encodes; pure-Python work (templates, validators) lets the
interpreter switch threads every few milliseconds; C work that holds the GIL (the JSON scanner) is bounded by the
body limit and made interruptible by ``bodies.py``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

HEAVY_WORKERS = 2
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(HEAVY_WORKERS, thread_name_prefix="grserve-heavy")
        return _pool


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a heavy-work thread; its exception is raised here."""
    return await asyncio.get_running_loop().run_in_executor(_executor(), fn, *args)
