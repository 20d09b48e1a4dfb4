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


def test_decode_ahead_on_cpu_decodes_its_micro_batches_at_once():
    """On CPU ``DecodeAhead`` decodes inline (nothing runs beside it), without grad, only the
    micro-batches this rank scores; the handle's result is the decoded tensor itself."""
    from miles.train.overlap import DecodeAhead

    calls = []

    def decode(latents):
        calls.append(torch.is_grad_enabled())
        return latents * 2

    ahead = DecodeAhead(decode, torch.device("cpu"), mine=lambda index: index % 2 == 1)
    x = torch.arange(3.0, requires_grad=True)
    assert ahead(0, x) is None and calls == []  # an sp peer scores micro-batch 0
    handle = ahead(1, x)
    assert handle.done() and calls == [False]  # decoded before the call returned
    torch.testing.assert_close(handle.result(), x.detach() * 2, rtol=0, atol=0)
    ahead.close()


def test_collector_decodes_each_micro_batch_right_after_its_last_step(monkeypatch):
    """With two experts, every micro-batch's high-noise steps come first; then the low-noise expert
    samples each micro-batch in turn, and micro-batch k is handed to ``decode_ahead`` as soon as its
    last step is done — before micro-batch k + 1's last steps, which are what the decode overlaps."""
    from types import SimpleNamespace

    from miles.train import collect

    events = []

    class Run:
        def __init__(self, k):
            self.k, self.next_step, self.x = k, 0, torch.tensor([float(k)])

        def run_steps(self, experts, start, stop):
            events.append(("steps", self.k, start, stop))
            self.next_step = stop

    monkeypatch.setattr(collect, "expert_phases", lambda *a: [(0, 0, 3), (1, 3, 5)])
    owner = SimpleNamespace(
        cfg=SimpleNamespace(
            rollout=SimpleNamespace(num_steps=5, shift=3.0, precision="bf16", attention_precision="bf16"),
            parallel=SimpleNamespace(rollout_unsharded=False, reshard_after_forward=True),
        ),
        algorithm=SimpleNamespace(rollout_transformers=lambda policy: ["high", "low"]),
        policy=None,
        model=SimpleNamespace(routing=None),
        schedule=3.0,  # Collector.schedule: the family's (a Wan shift here)
        progress=False,
        rank=0,
        rollout_index=0,
        stop=lambda: False,
        decode_ahead=lambda k, x: events.append(("decode", k, float(x))) or f"video {k}",
    )
    videos = collect.Collector._sample_expert_at_a_time(owner, [Run(0), Run(1), Run(2)])
    assert videos == ["video 0", "video 1", "video 2"]
    assert events == [
        ("steps", 0, 0, 3), ("steps", 1, 0, 3), ("steps", 2, 0, 3),
        ("steps", 0, 3, 5), ("decode", 0, 0.0),
        ("steps", 1, 3, 5), ("decode", 1, 1.0),
        ("steps", 2, 3, 5), ("decode", 2, 2.0),
    ]  # fmt: skip
