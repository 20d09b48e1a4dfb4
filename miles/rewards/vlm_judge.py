"""``vlm_judge``: a vision-language model scores each video through an OpenAI-compatible chat API.

    vllm serve Qwen/Qwen2.5-VL-7B-Instruct --port 8001        # or SGLang; or a UnifiedReward model
    options = {"url": "http://127.0.0.1:8001", "model": "Qwen/Qwen2.5-VL-7B-Instruct", "score_range": [1, 5]}
    rewards = build_rewards({"vlm_judge": 1.0}, {"vlm_judge": options})

Per video, ``num_frames`` frames sampled uniformly in time (``sample_frame_indices``) are
quantised with ``frames_to_uint8`` and sent as base64 PNG ``image_url`` parts, followed by the
question (``question``, formatted with ``{prompt}``, ``{lo}``, ``{hi}``, ``{num_frames}``), as
one ``POST {url}/v1/chat/completions`` per video at temperature 0; up to ``concurrency``
are in flight at once (vLLM and SGLang batch them). The constructor lists ``GET /v1/models`` to
refuse a missing server or an unknown model before the first rollout.

Score parsing (:func:`parse_score`): the number after the last ``score`` followed by ``:`` or
``=`` (case-insensitive: ``Score: 4``, ``Final Score = 3.5``), else an answer that is only a
number (``4``, ``4.``). It must lie in ``score_range`` [lo, hi] and maps to
``(s - lo) / (hi - lo)`` in [0, 1]. Any other answer is *unparsable*: it is counted
(``stats()["num_unparsable"]``, and ``last_unparsable`` for the last call) and ``unparsable``
decides the sample's fate: ``error`` (default) raises :class:`RemoteRewardError` quoting the
answer once the whole batch has been asked; ``min`` scores it 0.0, the bottom of the range (an
explicit penalty; never NaN, which would stop the trainer).

HTTP failures are handled as in :mod:`miles.rewards.remote`: connection errors, timeouts and
429/5xx are retried ``retries`` times with backoff ``backoff_s * 2**k``; another status or
a malformed answer raises :class:`RemoteRewardError` naming the URL.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import math
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar, Literal

import numpy as np
import requests
import torch
from PIL import Image
from requests.adapters import HTTPAdapter

from miles.rewards.base import Reward, check_num_frames, check_videos, frames_to_uint8, sample_frame_indices
from miles.rewards.registry import register_reward
from miles.rewards.remote import HttpClient, RemoteRewardError, check_http_options

DEFAULT_QUESTION = (
    "The {num_frames} images are frames sampled in order from one generated video. "
    'The video was generated for the prompt: "{prompt}". '
    "Rate how well the video shows what the prompt describes, and its visual quality, "
    "on a scale from {lo} (worst) to {hi} (best). "
    "Give a one-sentence reason, then end with a line 'Score: N'."
)
"""The question asked after the frames when ``question`` is None."""

API_KEY_ENV = ("MILES_VLM_API_KEY", "OPENAI_API_KEY")
"""Environment variables read, in order, for the bearer token when ``api_key`` is None."""

_NUMBER = r"[-+]?\d+(?:\.\d+)?"
SCORE_PATTERN = re.compile(rf"score\s*[:=]\s*\**\s*({_NUMBER})", re.IGNORECASE)
"""``Score: N`` / ``score = N`` (markdown bold allowed: ``Score: **4**``); the last match counts."""
BARE_NUMBER_PATTERN = re.compile(rf"\s*\**({_NUMBER})\**\s*\.?\s*")
"""An answer that is nothing but a number (matched in full)."""


def parse_score(answer: str, lo: float, hi: float) -> float | None:
    """The judge's score in [lo, hi] mapped to [0, 1], or None if ``answer`` holds none (module docstring)."""
    matches = SCORE_PATTERN.findall(answer)
    if matches:
        text = matches[-1]
    else:
        bare = BARE_NUMBER_PATTERN.fullmatch(answer)
        if bare is None:
            return None
        text = bare.group(1)
    score = float(text)
    if not lo <= score <= hi:
        return None
    return (score - lo) / (hi - lo)


def encode_png(frame: np.ndarray) -> str:
    """(H, W, 3) uint8 -> a ``data:image/png;base64,...`` URL."""
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _check_score_range(score_range: Sequence[float]) -> tuple[float, float]:
    ok = (
        isinstance(score_range, Sequence)
        and len(score_range) == 2
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in score_range)
    )
    if not ok or not all(math.isfinite(x) for x in score_range) or not score_range[0] < score_range[1]:
        raise ValueError(
            f"reward.vlm_judge.score_range must be [lo, hi] with lo < hi, e.g. [1, 5]; got {score_range!r}"
        )
    return float(score_range[0]), float(score_range[1])


def _check_positive_int(key: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"reward.vlm_judge.{key} must be a positive int; got {value!r}")
    return value


@dataclasses.dataclass(kw_only=True)
class VLMJudgeOptions:
    """``vlm_judge``: a vision-language model behind an OpenAI-compatible API rates each video."""

    RANGES: ClassVar[dict[str, tuple[str, str]]] = {
        "num_frames": ("[1, 4097]", ""),
        "score_range": ("[-1e6, 1e6]", ""),
        "timeout_s": ("(0, 86400]", ""),
        "retries": ("[0, 100]", ""),
        "backoff_s": ("[0, 3600]", ""),
        "concurrency": ("[1, 1024]", ""),
        "max_tokens": ("[1, 131072]", ""),
    }

    url: str | None = None
    """OpenAI-compatible server (vLLM, SGLang): POST {url}/v1/chat/completions."""
    model: str | None = None
    """The served model name; None: the only model the server lists."""
    api_key: str | None = None
    """Bearer token; None: $MILES_VLM_API_KEY or $OPENAI_API_KEY (prefer these: the config is saved in
    the run directory)."""
    question: str | None = None
    """Question after the frames, with {prompt} (and {lo}, {hi}, {num_frames}); None:
    miles.rewards.vlm_judge.DEFAULT_QUESTION, which asks for a final 'Score: N'."""
    num_frames: int = 4
    """Frames per video sent to the judge, sampled uniformly (this reward's own, not reward.num_frames)."""
    score_range: list[float] = dataclasses.field(default_factory=lambda: [1.0, 5.0])
    """[lo, hi] of the judge's scale; a score s maps to (s - lo) / (hi - lo)."""
    unparsable: Literal["error", "min"] = "error"
    """An answer without a score in range raises (error) or scores 0 (min); both count it."""
    timeout_s: float = 120.0
    """Seconds to wait for one answer."""
    retries: int = 3
    """Retries of a request after a connection error, timeout or HTTP 429/5xx."""
    backoff_s: float = 1.0
    """Wait before the first retry, doubled for each further one."""
    concurrency: int = 8
    """Requests in flight at once (one video each; the server batches them)."""
    max_tokens: int = 512
    """The answer's token limit (room for a short reason before the score)."""

    def check(self) -> None:
        """What the config refuses before any server is asked (ValueError naming the key)."""
        _check_score_range(self.score_range)


@register_reward("vlm_judge", options=VLMJudgeOptions)
class VLMJudge(Reward):
    """A VLM's rating of each video against its prompt, from sampled frames, mapped to [0, 1]."""

    name = "vlm_judge"

    def __init__(
        self,
        url: str | None = None,
        model: str | None = None,
        api_key: str | None = None,
        question: str | None = None,
        num_frames: int = 4,
        score_range: Sequence[float] = (1.0, 5.0),
        unparsable: str = "error",
        timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        concurrency: int = 8,
        max_tokens: int = 512,
    ) -> None:
        base = check_http_options("vlm_judge", url, timeout_s, retries, backoff_s)
        self.url = base.removesuffix("/v1")
        self.lo, self.hi = _check_score_range(score_range)
        self.num_frames = _check_positive_int("num_frames", check_num_frames(num_frames))
        self.concurrency = _check_positive_int("concurrency", concurrency)
        self.max_tokens = _check_positive_int("max_tokens", max_tokens)
        if unparsable not in ("error", "min"):
            raise ValueError(f"reward.vlm_judge.unparsable must be 'error' or 'min'; got {unparsable!r}")
        self.unparsable = unparsable
        self.question = DEFAULT_QUESTION if question is None else question
        if "{prompt}" not in self.question:
            raise ValueError(f"reward.vlm_judge.question must contain {{prompt}}; got {self.question!r}")
        try:
            self._question("x")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"reward.vlm_judge.question may use only {{prompt}}, {{lo}}, {{hi}}, {{num_frames}} "
                f"(double other braces); formatting it failed: {e!r}"
            ) from e
        api_key = api_key or next((os.environ[k] for k in API_KEY_ENV if os.environ.get(k)), None)
        session = requests.Session()  # thread-safe for plain requests (no cookies are used)
        adapter = HTTPAdapter(pool_maxsize=self.concurrency)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        if api_key:
            session.headers["Authorization"] = f"Bearer {api_key}"
        self.http = HttpClient(
            session,
            timeout_s=timeout_s,
            retries=retries,
            backoff_s=backoff_s,
            counters=("num_requests", "num_retries", "num_unparsable"),
        )
        self.last_unparsable = 0
        """Unparsable answers in the last call (``unparsable`` says what they scored)."""
        self.last_answers: list[str] = []
        """The judge's raw answers in the last call, one per video."""
        self.model = self._check_model(model)

    def _question(self, prompt: str) -> str:
        return self.question.format(
            prompt=prompt, lo=f"{self.lo:g}", hi=f"{self.hi:g}", num_frames=self.num_frames
        )

    def _check_model(self, model: str | None) -> str:
        """The served model to ask: ``model``, or the only one ``/v1/models`` lists; else ValueError."""
        url = f"{self.url}/v1/models"
        try:
            response = self.http.request("GET", url, timeout_s=min(self.http.timeout_s, 10.0))
            served = [m["id"] for m in response.json()["data"]]
        except (RemoteRewardError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"no OpenAI-compatible server answers GET {url} ({e}). Start the VLM server first "
                f"(e.g. vllm serve MODEL --port PORT) and set reward.vlm_judge.url to its base URL."
            ) from e
        if model is None:
            if len(served) != 1:
                raise ValueError(f"{url} serves {served}: set reward.vlm_judge.model to one of them")
            return served[0]
        if model not in served:
            raise ValueError(f"reward.vlm_judge.model={model!r} is not served at {url}; it serves {served}")
        return model

    def stats(self) -> dict[str, int]:
        """Counters since construction (``num_requests``, ``num_retries``, ``num_unparsable``) and
        ``last_unparsable``; the trainer can log them."""
        return {**self.http.counts(), "last_unparsable": self.last_unparsable}

    def _ask(self, frames: np.ndarray, prompt: str) -> str:
        """One chat completion for one video's frames (K, H, W, C) uint8: the answer's text."""
        content = [{"type": "image_url", "image_url": {"url": encode_png(f)}} for f in frames]
        content.append({"type": "text", "text": self._question(prompt)})
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
        }
        url = f"{self.url}/v1/chat/completions"
        self.http.count("num_requests")
        response = self.http.request("POST", url, json=payload)
        try:
            text = response.json()["choices"][0]["message"]["content"]
            if isinstance(text, list):  # some servers answer content parts
                text = "".join(p.get("text", "") for p in text if isinstance(p, dict))
            if not isinstance(text, str):
                raise TypeError(f"content is {type(text).__name__}")
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise RemoteRewardError(
                f"{url} answered no choices[0].message.content ({e!r}): {response.text[:300]!r}"
            ) from None
        return text

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_videos(videos, prompts)
        idx = sample_frame_indices(videos.shape[1], self.num_frames).to(videos.device)
        frames = frames_to_uint8(videos[:, idx])  # (B, K, H, W, C)
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(prompts))) as pool:
            answers = list(pool.map(self._ask, frames, prompts))
        parsed = [parse_score(a, self.lo, self.hi) for a in answers]
        bad = [i for i, s in enumerate(parsed) if s is None]
        self.last_answers, self.last_unparsable = answers, len(bad)
        self.http.count("num_unparsable", len(bad))
        if bad and self.unparsable == "error":
            i = bad[0]
            raise RemoteRewardError(
                f"the VLM judge at {self.url} gave {len(bad)} unparsable answer(s) of {len(answers)} "
                f"(no 'Score: N' with N in [{self.lo:g}, {self.hi:g}]); the first, for prompt "
                f"{prompts[i]!r}: {answers[i][:300]!r}. Fix reward.vlm_judge.question or score_range, or set "
                "reward.vlm_judge.unparsable: min to score such answers 0"
            )
        scores = [0.0 if s is None else s for s in parsed]  # unparsable min: the range's bottom
        return torch.tensor(scores, dtype=torch.float32, device=videos.device)

    def __repr__(self) -> str:
        return f"VLMJudge({self.url}, model={self.model!r})"
