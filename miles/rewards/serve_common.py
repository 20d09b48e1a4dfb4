"""What both reward-server engines share: the token check, request limits, the answer cache and scoring.

:mod:`miles.rewards.serve` runs the rewards on Ray Serve (:mod:`miles.rewards.serve_ray`) or, as a
fallback, on the standard library's HTTP server; both answer the same wire format
(:mod:`miles.rewards.remote`) through the functions here, so their answers, errors and
idempotency are the same.

Nothing from a request reaches a file path, a shell or a lookup outside the hosted rewards: the
body is parsed by safetensors and ``json``, reward names are checked against the hosted set
before use, the request id must be a short token of ``[0-9A-Za-z_.-]`` (it is only a cache key),
and prompts are passed to the rewards as strings.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from miles.rewards.base import Reward
from miles.rewards.remote import TOKEN_ENV, decode_request, dequantize_frames

DEFAULT_MAX_REQUEST_MB = 256
_REQUEST_ID = re.compile(r"[0-9A-Za-z_.-]{1,128}")


class RequestError(ValueError):
    """A request the server refuses with a 4xx status (the client's fault, not retried)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve a non-loopback address without a token (ValueError naming the fix)."""
    if token is not None and not token.strip():
        raise ValueError(f"the reward server token is empty; set --token or ${TOKEN_ENV} to a secret")
    if not token and not is_loopback(host):
        raise ValueError(
            f"refusing to serve on {host} without a token: anyone who reaches it could drive the "
            f"reward models. Set ${TOKEN_ENV} (or --token) to a shared secret here and for every "
            "trainer rank, or bind 127.0.0.1."
        )


def check_auth(authorization: str | None, token: str | None) -> None:
    """Raise a 401 :class:`RequestError` unless ``authorization`` is ``Bearer <token>`` (no token: open)."""
    if not token:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        what = "no token" if not authorization else "a wrong token"
        raise RequestError(
            f"this reward server needs its token; the request carried {what} "
            f"(set ${TOKEN_ENV} for the trainer, or reward.remote.token)",
            status=401,
        )


def check_length(content_length: str | None, max_bytes: int) -> int:
    """The declared body length, refused with 411 when absent or malformed and 413 when too large."""
    if content_length is None or not content_length.strip().isdigit():
        raise RequestError("POST /score needs a Content-Length", status=411)
    length = int(content_length)
    if length > max_bytes:
        raise RequestError(too_large(length, max_bytes), status=413)
    return length


def too_large(length: int, max_bytes: int) -> str:
    return (
        f"the request body is {length} bytes, over this server's limit of {max_bytes} "
        "(--max-request-mb); send fewer videos per request (reward.remote.batch_size) or fewer "
        "frames (reward.remote.num_frames)"
    )


def parse_score_body(body: bytes, hosted: Sequence[str]) -> tuple[np.ndarray, list[str], list[str], str]:
    """``decode_request`` plus the server's checks: 400 :class:`RequestError` for any defect."""
    try:
        frames, prompts, names, request_id = decode_request(body)
    except ValueError as e:
        raise RequestError(str(e)) from e
    if not _REQUEST_ID.fullmatch(request_id):
        raise RequestError(f"request_id must be 1-128 characters of [0-9A-Za-z_.-]; got {request_id[:40]!r}")
    unknown = [n for n in names if n not in hosted]
    if unknown or len(set(names)) != len(names):
        raise RequestError(f"this server does not host {unknown or names}; it hosts {list(hosted)}")
    return frames, prompts, names, request_id


def encode_answer(request_id: str, scores: Mapping[str, Sequence[float]]) -> bytes:
    return json.dumps({"request_id": request_id, "scores": dict(scores)}).encode()


class AnswerCache:
    """The answers of the last ``size`` request ids (least recently used dropped first)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._answers: OrderedDict[str, bytes] = OrderedDict()

    def get(self, request_id: str) -> bytes | None:
        answer = self._answers.get(request_id)
        if answer is not None:
            self._answers.move_to_end(request_id)
        return answer

    def put(self, request_id: str, answer: bytes) -> None:
        self._answers[request_id] = answer
        while len(self._answers) > self.size:
            self._answers.popitem(last=False)


def score_videos(
    rewards: Mapping[str, Reward], frames: np.ndarray, prompts: Sequence[str], names: Sequence[str]
) -> dict[str, list[float]]:
    """Each named reward on ``dequantize_frames(frames)``: ``{name: [B floats]}`` (exact float32 values).

    A reward's ``ValueError`` (a prompt it cannot score) becomes a 400 :class:`RequestError`.
    """
    videos = dequantize_frames(frames)  # (B, F, C, H, W) float32 u/255
    try:
        with torch.no_grad():
            scores = {n: rewards[n](videos, list(prompts)) for n in names}
    except ValueError as e:
        raise RequestError(f"a reward refused the batch: {e}") from e
    return {n: s.detach().float().cpu().tolist() for n, s in scores.items()}
