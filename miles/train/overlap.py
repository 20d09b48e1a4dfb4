"""Decode on this thread, score on a worker: reward scoring of micro-batch k overlaps the decode of k + 1.

    results = decode_and_score(chunks, decode, score, keep)   # [(chunk, keep(video, chunk), score), ...]

The VAE decode runs where the rollout ran (its device, its thread); one worker thread calls
``score`` on the decoded videos in order, so a reward model is never called from two threads at
once and a reward server's round trip (or a reward model on another device) hides behind the next
decode. Results come back in input order, so the numbers are those of the sequential loop.
Grad mode is per thread: the worker scores under ``torch.no_grad`` itself.

Memory: a decoded video is dropped as soon as it is scored; only what ``keep`` returns for it
(e.g. a uint8 CPU copy for logging, or None) outlives it. At most two videos are alive at once —
the one being scored and the one being decoded: the decode of k + 1 waits until k − 1 is scored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def _keep_video(video: torch.Tensor, item: Any) -> torch.Tensor:
    return video


def decode_and_score(
    items: Iterable[T],
    decode: Callable[[T], torch.Tensor],
    score: Callable[[torch.Tensor, T], Any],
    keep: Callable[[torch.Tensor, T], Any] = _keep_video,
) -> list[tuple[T, Any, Any]]:
    """``[(item, keep(video, item), score(video, item))]`` in input order, scoring overlapped with
    decoding; ``keep`` runs on the worker after scoring (default: the video itself)."""

    def scored(video: torch.Tensor, item: T) -> tuple[Any, Any]:
        with torch.no_grad():
            result = score(video, item)
            return keep(video, item), result

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-reward") as pool:
        pending: list[tuple[T, Future]] = []
        for k, item in enumerate(items):
            if k >= 2:
                pending[k - 2][1].result()  # bound the videos alive (a scoring error surfaces here)
            with torch.no_grad():
                video = decode(item)
            pending.append((item, pool.submit(scored, video, item)))
            del video
        return [(item, *future.result()) for item, future in pending]
