"""The reward server: host registered rewards over HTTP for the ``remote`` reward.

    python -m miles.rewards.serve --rewards world_adherence --port 8765
    python -m miles.rewards.serve --rewards pickscore --host 0.0.0.0 --port 8765 --replicas 4 \\
        --device cuda --max-batch-size 8 --pickscore-path /ckpt/PickScore_v1 --num-frames 4
    MILES_REWARD_TOKEN=... python -m miles.rewards.serve --rewards hpsv2 --host 0.0.0.0 \\
        --reward-option hpsv2.model_path=/ckpt/HPSv2 --reward-option hpsv2.processor_path=/ckpt/CLIP-ViT-H-14

The default engine is Ray Serve (:mod:`miles.rewards.serve_ray`): ``--replicas`` copies of the
rewards (each with ``--cpus-per-replica`` and, with ``--device cuda``, ``--gpus-per-replica``),
the videos of every request scored on whichever replica is free and batched across requests
and trainer ranks up to ``--max-batch-size`` videos per reward call; a local Ray instance is
started, or ``--ray-address`` joins a cluster. ``--engine threading`` is the fallback without
Ray: the standard library's ``ThreadingHTTPServer``, one process, one request scored at a time.

Both engines answer the wire format of :mod:`miles.rewards.remote` (``/health``, ``/score``,
``/stats``) with the same checks (:mod:`miles.rewards.serve_common`): a shared token
(``$MILES_REWARD_TOKEN`` or ``--token``; required to bind a non-loopback address; a request
without it gets 401), a body limit (``--max-request-mb``, 413), malformed bodies 400; and the
same idempotency: the answer to each request id is cached (the last ``--cache-size`` ids), so a
retried request is answered from the cache and its samples are scored once.

Test only: ``--fault-drop-first N`` scores and caches the first N new request ids and loses the
answer (the threading engine closes the connection, the Ray engine answers 503), so that the
client's retry is answered from the cache; ``--fault-hold-s S`` (Ray) holds every batch S seconds
before scoring, so a replica can be killed while it holds work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import traceback
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

from miles.rewards.base import Reward
from miles.rewards.registry import check_options, check_resources, registered_rewards
from miles.rewards.remote import TOKEN_ENV, WIRE_VERSION
from miles.rewards.serve_common import (
    DEFAULT_MAX_REQUEST_MB,
    AnswerCache,
    RequestError,
    check_auth,
    check_bind,
    check_length,
    encode_answer,
    parse_score_body,
    score_videos,
)

COUNTERS = ("num_requests", "num_scored_requests", "num_scored_samples", "num_cache_hits", "num_dropped")
COUNTERS += ("num_errors", "num_unauthorized")


class RewardService:
    """The threading engine's rewards, answer cache and counters, independent of HTTP."""

    def __init__(self, rewards: Mapping[str, Reward], cache_size: int = 1024, drop_first: int = 0) -> None:
        self.rewards = dict(rewards)
        self.cache = AnswerCache(cache_size)
        self._score_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._to_drop = drop_first
        self.counts = dict.fromkeys(COUNTERS, 0)

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.counts[key] += n

    def health(self) -> dict:
        return {"status": "ok", "version": WIRE_VERSION, "rewards": list(self.rewards)}

    def stats(self) -> dict:
        with self._stats_lock:
            return dict(self.counts, engine="threading")

    def score(self, body: bytes) -> tuple[bytes, bool]:
        """Answer a ``POST /score`` body: ``(JSON bytes, drop)``; ``drop`` asks to lose the answer.

        Raises :class:`RequestError` for a bad request or a reward's ``ValueError``; other
        exceptions are server errors. The cache is checked under the scoring lock, so a retry of
        a request still being scored waits for its answer instead of scoring it again.
        """
        self._count("num_requests")
        frames, prompts, names, request_id = parse_score_body(body, list(self.rewards))
        with self._score_lock:
            cached = self.cache.get(request_id)
            if cached is not None:
                self._count("num_cache_hits")
                return cached, False
            answer = encode_answer(request_id, score_videos(self.rewards, frames, prompts, names))
            self.cache.put(request_id, answer)
            self._count("num_scored_requests")
            self._count("num_scored_samples", len(prompts))
            drop = self._to_drop > 0
            self._to_drop -= int(drop)
        if drop:
            self._count("num_dropped")
        return answer, drop


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection per client
    service: RewardService  # these three are set on the subclass made by make_server
    token: str | None
    max_bytes: int

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(body)

    def _refuse(self, e: RequestError) -> None:
        self.service._count("num_unauthorized" if e.status == 401 else "num_errors")
        if e.status in (401, 411, 413):  # the body was not read: the connection cannot be reused
            self.close_connection = True
        self._send(e.status, json.dumps({"error": str(e)}).encode())

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        try:
            check_auth(self.headers.get("Authorization"), self.token)
        except RequestError as e:
            return self._refuse(e)
        if self.path == "/health":
            self._send(200, json.dumps(self.service.health()).encode())
        elif self.path == "/stats":
            self._send(200, json.dumps(self.service.stats()).encode())
        else:
            self._refuse(RequestError(f"no such endpoint {self.path}; try /health, /stats, POST /score", 404))

    def do_POST(self) -> None:  # noqa: N802
        try:
            check_auth(self.headers.get("Authorization"), self.token)
            if self.path != "/score":
                raise RequestError(f"no such endpoint {self.path}; POST /score", 404)
            length = check_length(self.headers.get("Content-Length"), self.max_bytes)
            answer, drop = self.service.score(self.rfile.read(length))
        except RequestError as e:
            return self._refuse(e)
        except Exception as e:  # a reward crashed: report it, keep serving
            self.service._count("num_errors")
            traceback.print_exc()
            self._send(500, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
            return
        if drop:
            self.close_connection = True  # the test-only fault: no answer, connection closed
            return
        self._send(200, answer)

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per request would flood the log; errors are printed where they happen


def make_server(
    service: RewardService,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    max_bytes: int = DEFAULT_MAX_REQUEST_MB << 20,
) -> ThreadingHTTPServer:
    """A threading HTTP server for ``service`` bound to ``host:port`` (port 0: a free one); not yet serving."""
    check_bind(host, token)
    attrs = {"service": service, "token": token, "max_bytes": max_bytes}
    server = ThreadingHTTPServer((host, port), type("RewardHandler", (_Handler,), attrs))
    server.daemon_threads = True
    return server


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m miles.rewards.serve", description=__doc__.split("\n")[0])
    p.add_argument("--rewards", required=True, help="comma-separated registered reward names to host")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one, printed)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 needs a token)")
    p.add_argument("--engine", choices=("ray", "threading"), default="ray", help="serving engine")
    p.add_argument("--replicas", type=int, default=1, help="copies of the rewards (ray)")
    p.add_argument("--max-batch-size", type=int, default=8, help="videos per batched reward call (ray)")
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="wait to fill a batch (ray)")
    p.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs per replica (ray)")
    p.add_argument("--gpus-per-replica", type=float, default=None, help="(ray) default 1 with --device cuda")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    p.add_argument("--token", default=None, help=f"shared token (prefer ${TOKEN_ENV}: argv is visible)")
    p.add_argument("--max-request-mb", type=float, default=DEFAULT_MAX_REQUEST_MB, help="body size limit")
    p.add_argument("--num-frames", type=int, default=None, help="reward num_frames (default: each reward's)")
    p.add_argument(
        "--pickscore-path", default=None, help="local PickScore_v1 folder (reward.pickscore.model_path)"
    )
    p.add_argument(
        "--pickscore-processor-path",
        default=None,
        help="local CLIP processor folder (reward.pickscore.processor_path)",
    )
    p.add_argument("--device", default=None, help="reward device: cpu (default) or cuda (cuda:N: threading)")
    p.add_argument("--dtype", default=None, help="dtype of reward models, e.g. bfloat16")
    p.add_argument(
        "--reward-option",
        action="append",
        default=[],
        metavar="NAME.KEY=VALUE",
        help="any other reward option, as its config key reward.NAME.KEY, e.g. hpsv2.model_path=/ckpt/HPSv2 "
        "(a YAML value); a KEY without NAME is a common argument (num_frames, device, dtype)",
    )
    p.add_argument("--cache-size", type=int, default=1024, help="answers kept for retried request ids")
    p.add_argument("--fault-drop-first", type=int, default=0, help="TEST ONLY: lose the first N answers")
    p.add_argument("--fault-hold-s", type=float, default=0.0, help="TEST ONLY (ray): hold each batch S s")
    return p.parse_args(argv)


def _reward_options(args: argparse.Namespace) -> dict:
    """The ``build_rewards`` keyword arguments of the command line: ``options`` (reward name -> its
    options) and the common arguments; ValueError for a malformed one."""
    common = {"num_frames": args.num_frames, "device": args.device, "dtype": args.dtype}
    common = {k: v for k, v in common.items() if v is not None}
    pickscore = {"model_path": args.pickscore_path, "processor_path": args.pickscore_processor_path}
    options: dict[str, dict] = {"pickscore": {k: v for k, v in pickscore.items() if v is not None}}
    for item in args.reward_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--reward-option takes NAME.KEY=VALUE; got {item!r}")
        name, dot, option = key.strip().replace("-", "_").rpartition(".")
        if dot:
            options.setdefault(name, {})[option] = yaml.safe_load(value)
        else:
            common[option] = yaml.safe_load(value)
    return {"options": {name: given for name, given in options.items() if given}, **common}


def _check_args(args: argparse.Namespace, names: list[str]) -> None:
    """What can be refused before any reward or Ray starts (ValueError naming the fix)."""
    if not names:
        raise ValueError(f"--rewards names no reward; registered rewards: {registered_rewards()}")
    for flag in ("replicas", "max_batch_size", "cache_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1; got {getattr(args, flag)}")
    if args.engine == "threading" and (args.replicas != 1 or args.fault_hold_s or args.ray_address):
        raise ValueError("--replicas, --ray-address and --fault-hold-s need --engine ray (the default)")
    if not args.max_request_mb > 0:
        raise ValueError(f"--max-request-mb must be > 0; got {args.max_request_mb}")
    check_bind(args.host, args.token)


def _check_options(options: dict) -> None:
    """Refuse an unknown reward, option or common argument here, not in every replica."""
    kwargs = dict(options)
    check_options(kwargs.pop("options", None), kwargs)


def _serve_threading(args: argparse.Namespace, names: list[str], options: dict) -> int:
    from miles.rewards.registry import build_rewards

    mix = build_rewards(dict.fromkeys(names, 1.0), **options)
    service = RewardService(mix.rewards, cache_size=args.cache_size, drop_first=args.fault_drop_first)
    try:
        server = make_server(service, args.host, args.port, args.token, int(args.max_request_mb * 2**20))
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    print(
        f"[miles] reward server listening on http://{host}:{port} (rewards: {', '.join(names)})", flush=True
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    args.token = args.token or os.environ.get(TOKEN_ENV) or None
    names = [n.strip() for n in args.rewards.split(",") if n.strip()]
    try:
        options = _reward_options(args)
        _check_args(args, names)
        _check_options(options)
        check_resources(names, **options)  # unknown names, missing weight folders: before Ray starts
        if args.engine == "threading":
            return _serve_threading(args, names, options)
        from miles.rewards.serve_ray import serve_ray

        return serve_ray(args, names, options)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
