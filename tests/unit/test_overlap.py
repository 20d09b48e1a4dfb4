"""Reward scoring overlaps the next micro-batch's decode (miles.train.overlap), in order, same results."""

from __future__ import annotations

import threading

import pytest
import torch

from miles.train.overlap import decode_and_score


def test_scoring_overlaps_the_next_decode():
    n = 3
    decoding = [threading.Event() for _ in range(n)]
    threads = {"decode": set(), "score": set()}

    def decode(k: int) -> torch.Tensor:
        threads["decode"].add(threading.current_thread().name)
        decoding[k].set()
        return torch.full((2,), float(k))

    def score(video: torch.Tensor, k: int) -> float:
        # Scoring micro-batch k waits for the decode of k + 1 to start: a loop that scores before it
        # decodes the next micro-batch never gets there and times out here.
        if k + 1 < n:
            assert decoding[k + 1].wait(timeout=5), (
                f"micro-batch {k + 1} was not decoding while {k} was scored"
            )
        assert not torch.is_grad_enabled()
        threads["score"].add(threading.current_thread().name)
        return 10.0 * float(video.sum())

    results = decode_and_score(range(n), decode, score)
    assert [(k, r) for k, _, r in results] == [(0, 0.0), (1, 20.0), (2, 40.0)]  # input order
    assert [v.tolist() for _, v, _ in results] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    assert threads["decode"] == {threading.current_thread().name}
    assert len(threads["score"]) == 1 and next(iter(threads["score"])).startswith("miles-reward")


def test_a_scoring_error_reaches_the_caller():
    def score(video, k):
        raise ValueError(f"reward refused micro-batch {k}")

    with pytest.raises(ValueError, match="micro-batch 0"):
        decode_and_score(range(2), lambda k: torch.zeros(1), score)


def test_videos_are_dropped_once_scored_and_only_what_keep_returns_survives():
    import gc
    import weakref

    n = 5
    refs: list = []
    alive_at_decode = []

    def decode(k: int) -> torch.Tensor:
        gc.collect()
        alive_at_decode.append(sum(r() is not None for r in refs))
        video = torch.full((3,), float(k))
        refs.append(weakref.ref(video))
        return video

    def keep(video: torch.Tensor, k: int):
        return (video * 2).to(torch.uint8) if k % 2 == 0 else None  # e.g. rank 0's logged videos

    results = decode_and_score(range(n), decode, lambda video, k: float(video.sum()), keep)
    gc.collect()
    assert [r() for r in refs] == [None] * n  # no decoded video outlives its scoring
    assert max(alive_at_decode) <= 1  # decoding k + 1 waits until k - 1 is scored: <= 2 alive
    assert [s for _, _, s in results] == [0.0, 3.0, 6.0, 9.0, 12.0]
    kept = [v for _, v, _ in results]
    assert [None if v is None else v.tolist() for v in kept] == [[0, 0, 0], None, [4, 4, 4], None, [8, 8, 8]]
