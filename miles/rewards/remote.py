"""``remote``: score videos with rewards hosted by a reward server (``python -m miles.rewards.serve``).

    python -m miles.rewards.serve --rewards world_adherence --port 8000       # start it first
    rewards = build_rewards({"remote": 1.0}, {"remote": {"url": "http://127.0.0.1:8000",
                                                         "rewards": {"world_adherence": 1.0}}})

A reward model that wants its own GPU, environment or process (a big CLIP, a VLM) runs once in
the server and every trainer rank sends it its decoded videos. The constructor checks the
server's ``/health`` and that it hosts the requested rewards (:func:`check_reward_server`, also
its ``check_resources``, which the dry run and the trainer call before any weights load), so a
missing server, a wrong token or an unhosted reward is refused before the first rollout. A
server started with a token (``$MILES_REWARD_TOKEN``) gets it as ``Authorization: Bearer``
from ``reward.remote.token`` or that variable.

Wire format (version 1; docs/rewards.md has the details):

- ``GET /health`` -> ``{"status": "ok", "version": 1, "rewards": [hosted names]}``.
- ``POST /score``: a safetensors file holding ``videos`` (B, F, H, W, C) uint8 (``frames_to_uint8``)
  with string metadata ``request_id`` (uuid4 hex), ``prompts`` and ``rewards`` (JSON lists) ->
  ``{"request_id": ..., "scores": {name: [B floats]}}``; an error is ``{"error": message}``.
- ``GET /stats`` -> the server's counters (requests, scored samples, cache hits, dropped answers).

Quantisation: the server scores ``dequantize_frames(frames)`` = uint8 / 255 as float32, so a
remote score equals, bitwise, the in-process score of ``dequantize_frames(frames_to_uint8(videos))``.
Rewards that quantise frames themselves (JPEG sizes, PickScore) give the in-process score of the
original videos; float rewards (``sharpness``, ``world_adherence``) see frames rounded to 1/255.
The combined score is summed client-side in the order of ``reward.remote.rewards``, as ``MultiReward``
does, so ``{"remote": 1}`` with ``rewards`` W matches an in-process mix W bitwise.

Failures: connection errors, timeouts, dropped connections and HTTP 429/5xx are retried ``retries``
times by urllib3's ``Retry`` (mounted through ``requests``' ``HTTPAdapter``: :func:`retry_policy`; the
first retry at once, then ``backoff_s * 2**(k-1)`` before retry k, or the server's ``Retry-After``);
each request carries one id over all its
retries and the server caches its answer per id, so a retried batch is scored once and no sample
is lost. Other HTTP errors, a malformed body or a wrong number of scores raise
:class:`RemoteRewardError` at once, naming the URL.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import requests
import torch
from requests.adapters import HTTPAdapter
from urllib3.util import Retry

from miles.rewards.base import Reward, check_num_frames, check_videos, frames_to_uint8, sample_frame_indices
from miles.rewards.registry import register_reward

WIRE_VERSION = 1
TOKEN_ENV = "MILES_REWARD_TOKEN"
"""The environment variable holding the reward server's shared token (server and trainer ranks)."""
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
"""HTTP statuses worth retrying: overload and server-side failures (a 4xx is the request's fault)."""
_CONNECT_TIMEOUT_S = 10.0


class RemoteRewardError(RuntimeError):
    """A reward server (or VLM endpoint) was unreachable after all retries or answered badly;
    the message names its URL."""


def dequantize_frames(frames: np.ndarray) -> torch.Tensor:
    """(B, F, H, W, C) uint8 -> (B, F, C, H, W) float32 ``u / 255``: the frames the server scores.

    ``frames_to_uint8(dequantize_frames(u)) == u`` for every uint8 ``u``.
    """
    x = torch.from_numpy(np.ascontiguousarray(frames))
    return x.permute(0, 1, 4, 2, 3).float() / 255.0


def encode_request(
    frames: np.ndarray, prompts: Sequence[str], rewards: Sequence[str], request_id: str
) -> bytes:
    """The ``POST /score`` body: safetensors bytes of ``videos`` (B, F, H, W, C) uint8 plus metadata."""
    from safetensors.numpy import save

    metadata = {
        "version": str(WIRE_VERSION),
        "request_id": request_id,
        "prompts": json.dumps(list(prompts)),
        "rewards": json.dumps(list(rewards)),
    }
    return save({"videos": np.ascontiguousarray(frames)}, metadata=metadata)


def decode_request(body: bytes) -> tuple[np.ndarray, list[str], list[str], str]:
    """``encode_request``'s inverse: ``(frames, prompts, rewards, request_id)``; ValueError if malformed."""
    from safetensors.numpy import load

    try:
        # safetensors layout: u64 little-endian header length, JSON header (with __metadata__), data
        header_len = int.from_bytes(body[:8], "little")
        metadata = json.loads(body[8 : 8 + header_len]).get("__metadata__") or {}
        tensors = load(body)
        prompts, rewards = json.loads(metadata["prompts"]), json.loads(metadata["rewards"])
        request_id, version = metadata["request_id"], int(metadata["version"])
        frames = tensors["videos"]
    except Exception as e:  # any defect of the body is the client's: HTTP 400
        raise ValueError(f"malformed /score body ({type(e).__name__}: {e})") from e
    if version != WIRE_VERSION:
        raise ValueError(f"wire version {version} is not supported (this server speaks {WIRE_VERSION})")
    if frames.dtype != np.uint8 or frames.ndim != 5 or frames.shape[-1] != 3:
        raise ValueError(f"videos must be (B, F, H, W, 3) uint8; got {frames.dtype} {frames.shape}")
    if 0 in frames.shape:
        raise ValueError(
            f"videos (B, F, H, W, 3) must hold at least one video of at least one frame of at least 1x1 "
            f"pixels; got {frames.shape}"
        )
    ok_strings = all(isinstance(x, list) and all(isinstance(s, str) for s in x) for x in (prompts, rewards))
    if not ok_strings or len(prompts) != frames.shape[0] or not rewards:
        raise ValueError(
            f"metadata must hold {frames.shape[0]} prompts and at least one reward name, as JSON lists of str"
        )
    return frames, prompts, rewards, str(request_id)


def error_text(response: requests.Response) -> str:
    """The ``error`` of a JSON error body, else the start of the body."""
    try:
        body = response.json()
        if isinstance(body, dict) and "error" in body:
            return str(body["error"])
    except ValueError:
        pass
    return repr(response.text[:300])


def retry_policy(retries: int, backoff_s: float) -> Retry:
    """urllib3's ``Retry`` for the HTTP rewards: up to ``retries`` retries of a connection error, a
    timeout, a dropped connection or a ``RETRY_STATUS`` answer, for every method (``POST /score`` is
    idempotent: the server keeps each request id's answer), honouring ``Retry-After``; urllib3 waits
    0 s before the first retry and ``backoff_s * 2**(k-1)`` before retry k >= 2. The last answer of
    a status that ran out of retries is returned, not raised, so its error text can be shown."""
    return Retry(
        total=retries,
        connect=retries,
        read=retries,
        status=retries,
        allowed_methods=None,
        status_forcelist=RETRY_STATUS,
        backoff_factor=backoff_s,
        raise_on_status=False,
    )


class HttpClient:
    """A ``requests`` session whose retries are urllib3's (:func:`retry_policy`, mounted through
    ``requests``' ``HTTPAdapter``), with thread-safe counters: what the HTTP rewards (``remote``,
    ``vlm_judge``) share. Retries are counted as ``num_retries``."""

    def __init__(
        self,
        session: requests.Session,
        *,
        timeout_s: float,
        retries: int,
        backoff_s: float,
        counters: Sequence[str],
    ) -> None:
        self.session = session
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), retries, backoff_s
        adapter = HTTPAdapter(max_retries=retry_policy(retries, backoff_s))
        for scheme in ("http://", "https://"):
            session.mount(scheme, adapter)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(counters, 0)

    def request(
        self, method: str, url: str, timeout_s: float | None = None, **kwargs: Any
    ) -> requests.Response:
        """Send one request (retried by the session); return the first 2xx response. Raises
        :class:`RemoteRewardError` naming ``url`` for another status (not retried) or once the
        retries ran out."""
        timeout_s = timeout_s or self.timeout_s
        attempts = f"failed after {self.retries + 1} attempt(s); last error"
        try:
            response = self.session.request(
                method, url, timeout=(min(_CONNECT_TIMEOUT_S, timeout_s), timeout_s), **kwargs
            )
        except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
            self.count("num_retries", self.retries)
            raise RemoteRewardError(f"{method} {url} {attempts}: {type(e).__name__}: {e}") from None
        retried = getattr(response.raw, "retries", None)
        self.count("num_retries", len(retried.history) if retried is not None else 0)
        if response.status_code in RETRY_STATUS:  # its retries ran out
            raise RemoteRewardError(
                f"{method} {url} {attempts}: HTTP {response.status_code}: {error_text(response)}"
            )
        if not response.ok:
            raise RemoteRewardError(
                f"{method} {url} was refused with HTTP {response.status_code} (not retried): "
                f"{error_text(response)}"
            )
        return response

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def check_http_options(prefix: str, url: str | None, timeout_s: float, retries: int, backoff_s: float) -> str:
    """Validate the URL, timeout and retry options of an HTTP reward; returns the URL without a final /."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"reward.{prefix}.url must be an http(s):// base URL; got {url!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"reward.{prefix}.timeout_s must be > 0 seconds; got {timeout_s!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"reward.{prefix}.retries must be an int >= 0; got {retries!r}")
    if isinstance(backoff_s, bool) or not isinstance(backoff_s, (int, float)) or backoff_s < 0:
        raise ValueError(f"reward.{prefix}.backoff_s must be >= 0 seconds; got {backoff_s!r}")
    return url.rstrip("/")


def _resolve_weights(
    remote_rewards: Mapping[str, float] | Sequence[str] | str | None, hosted: list[str], url: str
) -> dict[str, float]:
    """``remote_rewards`` as ``{name: weight}`` (a name or list: weight 1; None: all hosted), checked."""
    if remote_rewards is None:
        weights = {name: 1.0 for name in hosted}
    elif isinstance(remote_rewards, str):
        weights = {name.strip(): 1.0 for name in remote_rewards.split(",") if name.strip()}
    elif isinstance(remote_rewards, Mapping):
        weights = dict(remote_rewards)
    else:
        weights = {name: 1.0 for name in remote_rewards}
    if not weights:
        raise ValueError("reward.remote.rewards names no reward; None asks for every reward the server hosts")
    for name, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"reward.remote.rewards.{name} must be a finite number; got {weight!r}")
    missing = sorted(set(weights) - set(hosted))
    if missing:
        raise ValueError(
            f"the reward server at {url} does not host {missing}; it hosts {hosted} "
            "(restart it with those names in --rewards, or change reward.remote.rewards)"
        )
    return {name: float(w) for name, w in weights.items()}


def auth_headers(token: str | None = None) -> dict[str, str]:
    """``Authorization: Bearer`` for ``token``, else ``$MILES_REWARD_TOKEN``; none when neither is set."""
    token = token or os.environ.get(TOKEN_ENV)
    return {"Authorization": f"Bearer {token}"} if token else {}


def _health(http: HttpClient, url: str) -> list[str]:
    """The rewards the server at ``url`` hosts, from ``GET /health``; ValueError naming the fix."""
    start = "python -m miles.rewards.serve --rewards NAME[,NAME...] --port PORT"
    try:
        response = http.request("GET", url + "/health", timeout_s=min(http.timeout_s, _CONNECT_TIMEOUT_S))
        body = response.json()
        hosted = body["rewards"]
        if body.get("version") != WIRE_VERSION or not all(isinstance(n, str) for n in hosted):
            raise ValueError(f"unexpected /health answer {body!r}")
    except (RemoteRewardError, ValueError, KeyError, TypeError) as e:
        if isinstance(e, RemoteRewardError) and ("HTTP 401" in str(e) or "HTTP 403" in str(e)):
            raise ValueError(
                f"the reward server at {url} refused this client's token ({e}); set ${TOKEN_ENV} "
                "(or reward.remote.token) to the token the server was started with"
            ) from e
        raise ValueError(
            f"no miles reward server (wire version {WIRE_VERSION}) answers at {url}/health ({e}). "
            f"Start one before training: {start}, and set reward.remote.url to its address."
        ) from e
    return list(hosted)


def _connect(
    url: str | None,
    rewards: Mapping[str, float] | Sequence[str] | str | None,
    token: str | None,
    timeout_s: float,
    retries: int,
    backoff_s: float,
    counters: tuple[str, ...],
) -> tuple[HttpClient, str, list[str], dict[str, float]]:
    """A client of the reward server at ``url`` (with ``token``), checked: the server answers and
    hosts ``rewards``. Returns the client, the checked url, what it hosts and the weights."""
    url = check_http_options("remote", url, timeout_s, retries, backoff_s)
    http = HttpClient(
        requests.Session(), timeout_s=timeout_s, retries=retries, backoff_s=backoff_s, counters=counters
    )
    http.session.headers.update(auth_headers(token))
    hosted = _health(http, url)
    return http, url, hosted, _resolve_weights(rewards, hosted, url)


def check_reward_server(
    url: str | None,
    rewards: Mapping[str, float] | Sequence[str] | str | None = None,
    token: str | None = None,
    timeout_s: float = 300.0,
    retries: int = 3,
    backoff_s: float = 0.5,
) -> list[str]:
    """Check that a reward server answers at ``url`` (with ``token``) and hosts ``rewards``; returns
    what it hosts. ValueError naming the fix otherwise: call it before any weights load."""
    return _connect(url, rewards, token, timeout_s, retries, backoff_s, ("num_retries",))[2]


@dataclasses.dataclass(kw_only=True)
class RemoteOptions:
    """``remote``: rewards computed by a reward server (``python -m miles.rewards.serve``), weighted."""

    RANGES: ClassVar[dict[str, tuple[str, str]]] = {
        "rewards": ("[-1000, 1000]", "a weight of the reward mix"),
        "timeout_s": ("(0, 86400]", ""),
        "retries": ("[0, 100]", ""),
        "backoff_s": ("[0, 3600]", ""),
        "batch_size": ("[1, 65536]", ""),
        "num_frames": ("[1, 4097]", ""),
    }
    SECRETS: ClassVar[tuple[str, ...]] = ("token",)
    """Fields written out (config.yaml, checkpoints, wandb) only as whether they were set."""

    url: str | None = None
    """Base URL of a reward server (start it first: ``python -m miles.rewards.serve``)."""
    rewards: dict[str, float] | None = None
    """Reward name -> weight the server computes; None: every reward it hosts, weight 1."""
    timeout_s: float = 300.0
    """Seconds to wait for the answer to one request (the server scores its whole batch)."""
    retries: int = 3
    """Retries of a request after a connection error, timeout or HTTP 429/5xx."""
    backoff_s: float = 0.5
    """Wait before the first retry, doubled for each further one."""
    batch_size: int | None = None
    """Videos per request; None: each scoring call in one request."""
    num_frames: int | None = None
    """Send only this many frames per video, sampled uniformly (match the server's --num-frames to keep
    frame-sampling rewards exact); None: every frame. This reward's own, not reward.num_frames."""
    token: str | None = None
    """The server's token; None: $MILES_REWARD_TOKEN (prefer it: a recipe file travels). Never written out:
    config.yaml, checkpoints and wandb record only that it was set."""


@register_reward("remote", options=RemoteOptions)
class RemoteReward(Reward):
    """The weighted sum of rewards computed by a reward server, sent uint8 frames over HTTP."""

    name = "remote"

    def __init__(
        self,
        url: str | None = None,
        rewards: Mapping[str, float] | Sequence[str] | str | None = None,
        timeout_s: float = 300.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        batch_size: int | None = None,
        num_frames: int | None = None,
        token: str | None = None,
    ) -> None:
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ValueError(f"reward.remote.batch_size must be a positive int or None; got {batch_size!r}")
        self.batch_size = batch_size
        self.num_frames = check_num_frames(num_frames)
        self.last_scores: dict[str, torch.Tensor] = {}
        """The unweighted score of each remote reward in the last call, (B,) float32 on the videos' device."""
        counters = ("num_requests", "num_retries", "num_samples")
        self.http, self.url, self.hosted, self.weights = _connect(
            url, rewards, token, timeout_s, retries, backoff_s, counters
        )

    @staticmethod
    def check_resources(
        url: str | None = None,
        rewards: Mapping[str, float] | Sequence[str] | str | None = None,
        timeout_s: float = 300.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        token: str | None = None,
        **_: object,
    ) -> list[str]:
        """The dry run's and trainer's check before any weights load: :func:`check_reward_server`."""
        return check_reward_server(url, rewards, token, timeout_s, retries, backoff_s)

    def stats(self) -> dict[str, int]:
        """Counters since construction: ``num_requests``, ``num_retries``, ``num_samples`` (scored)."""
        return self.http.counts()

    def _score_batch(self, frames: np.ndarray, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """One ``POST /score`` (one request id for all its retries): per-reward (b,) float32 scores."""
        request_id = uuid.uuid4().hex
        names = list(self.weights)
        body = encode_request(frames, prompts, names, request_id)
        self.http.count("num_requests")
        response = self.http.request(
            "POST", self.url + "/score", data=body, headers={"Content-Type": "application/octet-stream"}
        )
        where = f"the reward server at {self.url}/score"
        try:
            answer = response.json()
        except ValueError:
            raise RemoteRewardError(
                f"{where} answered a body that is not JSON: {response.text[:300]!r}"
            ) from None
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, dict) or answer.get("request_id") != request_id:
            raise RemoteRewardError(
                f"{where} answered {str(answer)[:300]!r}; expected "
                f"{{'request_id': {request_id!r}, 'scores': {{name: [scores]}}}}"
            )
        out = {}
        for name in names:
            values = scores.get(name)
            if not isinstance(values, list) or len(values) != len(prompts):
                got = f"{len(values)} scores" if isinstance(values, list) else repr(values)[:100]
                raise RemoteRewardError(
                    f"{where} returned {got} for reward {name!r}; expected {len(prompts)}"
                )
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                raise RemoteRewardError(
                    f"{where} returned non-numeric scores for reward {name!r}: {values[:8]}"
                )
            out[name] = torch.tensor(values, dtype=torch.float32)
        self.http.count("num_samples", len(prompts))
        return out

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_videos(videos, prompts)
        idx = sample_frame_indices(videos.shape[1], self.num_frames).to(videos.device)
        frames = frames_to_uint8(videos[:, idx])  # (B, K, H, W, C) uint8
        batch = videos.shape[0]
        step = self.batch_size or batch
        parts = [
            self._score_batch(frames[i : i + step], prompts[i : i + step]) for i in range(0, batch, step)
        ]
        per_reward = {name: torch.cat([p[name] for p in parts]) for name in self.weights}
        # the sum MultiReward would form in-process, in the same order: bitwise equal mixes
        combined = torch.zeros(batch, dtype=torch.float32)
        for name, weight in self.weights.items():
            combined = combined + weight * per_reward[name]
        self.last_scores = {name: s.to(videos.device) for name, s in per_reward.items()}
        return combined.to(videos.device)

    def __repr__(self) -> str:
        return f"RemoteReward({self.url}, {self.weights})"
