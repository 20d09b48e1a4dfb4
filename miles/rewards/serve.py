"""A reward server: host registered rewards over HTTP for the ``remote`` reward.

    python -m miles.rewards.serve --rewards world_adherence --port 8000
    python -m miles.rewards.serve --rewards pickscore,jpeg_incompressibility --port 8000 --host 0.0.0.0 \\
        --pickscore-path /ckpt/PickScore_v1 --device cuda:1 --dtype bfloat16 --num-frames 4
    python -m miles.rewards.serve --rewards hpsv2,videoalign --reward-option hps_path=/ckpt/HPSv2 \
        --reward-option hps_processor_path=/ckpt/CLIP-ViT-H-14 --reward-option videoalign_path=/ckpt/VideoReward

The rewards are built once at startup with ``build_rewards`` (the same options the trainer's
``reward`` section takes, so start the server with the trainer's ``--num-frames``), then
``POST /score`` requests are scored one at a time: a lock serialises scoring (reward models are
not shared between threads) while ``/health`` and ``/stats`` stay answerable. The wire format is
in :mod:`miles.rewards.remote`.

Idempotency: the answer to each request id is cached (the last ``--cache-size`` ids) and checked
under the scoring lock, so a request that the client retries (because its answer was lost, or
timed out while being scored) is answered from the cache and its samples are scored once;
``/stats`` counts scored samples and cache hits.

Test only: ``--fault-drop-first N`` scores and caches the first N new request ids, then closes
the connection without answering them, as a network fault would; the tests use it to check
that the client's retry is answered from the cache.

Standard library HTTP (``ThreadingHTTPServer``); no authentication: bind to 127.0.0.1 (the
default) or a trusted network.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import traceback
from collections import OrderedDict
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import yaml

from miles.rewards.base import Reward
from miles.rewards.registry import build_rewards
from miles.rewards.remote import WIRE_VERSION, decode_request, dequantize_frames


class RequestError(ValueError):
    """A request the server refuses (HTTP 400): the client's fault, not retried."""


class RewardService:
    """The rewards, the per-request-id answer cache and the counters, independent of HTTP."""

    def __init__(self, rewards: Mapping[str, Reward], cache_size: int = 1024, drop_first: int = 0) -> None:
        self.rewards = dict(rewards)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._score_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._to_drop = drop_first
        keys = ("num_requests", "num_scored_requests", "num_scored_samples", "num_cache_hits", "num_dropped")
        self.counts = dict.fromkeys((*keys, "num_errors"), 0)

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.counts[key] += n

    def health(self) -> dict:
        return {"status": "ok", "version": WIRE_VERSION, "rewards": list(self.rewards)}

    def stats(self) -> dict:
        with self._stats_lock:
            return dict(self.counts)

    def score(self, body: bytes) -> tuple[bytes, bool]:
        """Answer a ``POST /score`` body: ``(JSON bytes, drop)``; ``drop`` asks to lose the answer.

        Raises :class:`RequestError` for a bad request or a reward's ``ValueError`` (a prompt it
        cannot score); other exceptions are server errors.
        """
        self._count("num_requests")
        try:
            frames, prompts, names, request_id = decode_request(body)
        except ValueError as e:
            raise RequestError(str(e)) from e
        unknown = [n for n in names if n not in self.rewards]
        if unknown:
            raise RequestError(f"this server does not host {unknown}; it hosts {list(self.rewards)}")
        with self._score_lock:
            if request_id in self._cache:
                self._count("num_cache_hits")
                self._cache.move_to_end(request_id)
                return self._cache[request_id], False
            videos = dequantize_frames(frames)  # (B, F, C, H, W) float32 u/255
            try:
                with torch.no_grad():
                    scores = {n: self.rewards[n](videos, prompts) for n in names}
            except ValueError as e:
                raise RequestError(f"a reward refused the batch: {e}") from e
            scores = {n: s.detach().float().cpu().tolist() for n, s in scores.items()}
            answer = json.dumps({"request_id": request_id, "scores": scores}).encode()
            self._cache[request_id] = answer
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self._count("num_scored_requests")
            self._count("num_scored_samples", len(prompts))
            drop = self._to_drop > 0
            self._to_drop -= int(drop)
        if drop:
            self._count("num_dropped")
        return answer, drop


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection per client
    service: RewardService  # set on the subclass made by make_server

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_json(self, status: int, obj: dict) -> None:
        self._send(status, json.dumps(obj).encode())

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == "/health":
            self._send_json(200, self.service.health())
        elif self.path == "/stats":
            self._send_json(200, self.service.stats())
        else:
            self._send_json(404, {"error": f"no such endpoint {self.path}; try /health, /stats, POST /score"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/score":
            self._send_json(404, {"error": f"no such endpoint {self.path}; POST /score"})
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._send_json(411, {"error": "POST /score needs a Content-Length"})
            return
        body = self.rfile.read(int(length))
        try:
            answer, drop = self.service.score(body)
        except RequestError as e:
            self.service._count("num_errors")
            self._send_json(400, {"error": str(e)})
            return
        except Exception as e:  # a reward crashed: report it, keep serving
            self.service._count("num_errors")
            traceback.print_exc()
            self._send_json(500, {"error": f"{type(e).__name__}: {e}"})
            return
        if drop:
            self.close_connection = True  # the test-only fault: no answer, connection closed
            return
        self._send(200, answer)

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per request would flood the log; errors are printed where they happen


def make_server(service: RewardService, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """An HTTP server for ``service`` bound to ``host:port`` (port 0: a free one); not yet serving."""
    handler = type("RewardHandler", (_Handler,), {"service": service})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m miles.rewards.serve", description=__doc__.split("\n")[0])
    p.add_argument("--rewards", required=True, help="comma-separated registered reward names to host")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one, printed)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    p.add_argument("--num-frames", type=int, default=None, help="reward num_frames (default: each reward's)")
    p.add_argument("--pickscore-path", default=None, help="local PickScore_v1 folder (pickscore)")
    p.add_argument("--pickscore-processor-path", default=None, help="local CLIP processor folder (pickscore)")
    p.add_argument("--device", default=None, help="device of reward models, e.g. cuda:1 (default: cpu)")
    p.add_argument("--dtype", default=None, help="dtype of reward models, e.g. bfloat16")
    p.add_argument(
        "--reward-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other reward option (a reward.* config field), e.g. hps_path=/ckpt/HPSv2 (YAML value)",
    )
    p.add_argument("--cache-size", type=int, default=1024, help="answers kept for retried request ids")
    p.add_argument("--fault-drop-first", type=int, default=0, help="TEST ONLY: lose the first N answers")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    names = [n.strip() for n in args.rewards.split(",") if n.strip()]
    options = {
        "num_frames": args.num_frames,
        "pickscore_path": args.pickscore_path,
        "pickscore_processor_path": args.pickscore_processor_path,
        "device": args.device,
        "dtype": args.dtype,
    }
    options = {k: v for k, v in options.items() if v is not None}
    for item in args.reward_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"error: --reward-option takes KEY=VALUE; got {item!r}", file=sys.stderr)
            return 2
        options[key.strip().replace("-", "_")] = yaml.safe_load(value)
    try:
        mix = build_rewards({n: 1.0 for n in names}, **options)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    service = RewardService(mix.rewards, cache_size=args.cache_size, drop_first=args.fault_drop_first)
    try:
        server = make_server(service, args.host, args.port)
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


if __name__ == "__main__":
    sys.exit(main())
