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

With ``rollout.overlap_decode`` the decode moves earlier still: :class:`DecodeAhead` decodes each
micro-batch as soon as its last denoising step is sampled, while the transformer samples the next
one, and scoring takes the finished frames (see there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

__all__ = ["DecodeAhead", "decode_and_score"]

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


class DecodeAhead:
    """Decode each micro-batch while the transformer samples the next (``rollout.overlap_decode``).

        ahead = DecodeAhead(model.decode, device, mine=lambda index: index % sp == sp_rank)
        handle = ahead(index, final_latents)   # the collector, once micro-batch ``index`` is sampled
        frames = handle.result()               # scoring: the decoded frames (fp32, on the host on CUDA)

    On CUDA a worker thread decodes on a side stream that first waits for the latents' last step,
    so the VAE's kernels run beside the transformer's on micro-batch ``index + 1`` (the GPU shares its
    SMs: how much of the decode hides is measured, not promised; the last micro-batch's decode has
    nothing to hide behind). The frames go to pinned host memory as soon as they are decoded, so the
    videos of a long rollout do not pile up on the GPU; scoring copies each back when it scores it.
    The same kernels run on the same inputs: the frames are bitwise those decoded after the rollout.
    Memory: one decode workspace beside the rollout's (``ResidentMemory.decode_beside_rollout``).

    On CPU there is nothing to run beside: each micro-batch is decoded at once, inline, so the
    numbers and the order of every operation on a rank are those of a run without the option.
    ``mine(index)``: whether this rank scores micro-batch ``index`` (sp peers split them); others
    are not decoded (the call returns None).
    """

    def __init__(self, decode: Callable[[torch.Tensor], torch.Tensor], device: torch.device, mine):
        self.decode, self.device, self.mine = decode, device, mine
        self._pool: ThreadPoolExecutor | None = None
        self._stream = None
        if device.type == "cuda":
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-decode")
            self._stream = torch.cuda.Stream(device=device)

    def __call__(self, index: int, latents: torch.Tensor) -> Future | None:
        if not self.mine(index):
            return None
        if self._pool is None:
            done: Future = Future()
            with torch.no_grad():
                done.set_result(self.decode(latents))
            return done
        sampled = torch.cuda.Event()
        sampled.record(torch.cuda.current_stream(self.device))
        return self._pool.submit(self._decode_beside, latents, sampled)

    def _decode_beside(self, latents: torch.Tensor, sampled) -> torch.Tensor:
        """The worker: decode on the side stream once ``sampled`` has passed, then the frames to host."""
        stream = self._stream
        with torch.no_grad(), torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_event(sampled)
            latents.record_stream(stream)  # the allocator keeps them until this stream is done
            video = self.decode(latents)
            host = torch.empty(video.shape, dtype=video.dtype, pin_memory=True)
            host.copy_(video, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
            del video  # freed on this stream: reused only after the copy
        copied.synchronize()
        return host

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
