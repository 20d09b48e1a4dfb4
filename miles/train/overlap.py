"""Decode on this thread, score on a worker: reward scoring of micro-batch k overlaps the decode of k + 1.

    results = decode_and_score(chunks, decode, score)   # [(chunk, video, score(video, chunk)), ...]

The VAE decode runs where the rollout ran (its device, its thread); one worker thread calls
``score`` on the decoded videos in order, so a reward model is never called from two threads at
once and a reward server's round trip (or a reward model on another device) hides behind the next
decode. Results come back in input order, so the numbers are those of the sequential loop.
Grad mode is per thread: the worker scores under ``torch.no_grad`` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def decode_and_score(
    items: Iterable[T], decode: Callable[[T], torch.Tensor], score: Callable[[torch.Tensor, T], Any]
) -> list[tuple[T, torch.Tensor, Any]]:
    """``[(item, decode(item), score(video, item))]`` in input order, scoring overlapped with decoding."""

    def scored(video: torch.Tensor, item: T) -> Any:
        with torch.no_grad():
            return score(video, item)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-reward") as pool:
        pending = []
        for item in items:
            with torch.no_grad():
                video = decode(item)
            pending.append((item, video, pool.submit(scored, video, item)))
        return [(item, video, future.result()) for item, video, future in pending]
