"""The reward server on Ray Serve: replicas of the rewards, batching across requests, one ingress.

Two deployments (started by ``python -m miles.rewards.serve``, :func:`serve_ray`):

- ``RewardIngress`` (one replica, no CPU reserved) answers HTTP: the token, the size limit, the
  body checks and the per-request-id answer cache (with in-flight requests: a retry of a request
  still being scored waits for that scoring instead of starting another). It sends each video
  of a request as one call to the scorers, so the engine, not the trainer, spreads a batch over
  the replicas, and gathers the answer in order. A call lost with its replica (killed, crashed,
  node lost) is sent again, to a live replica: ``/stats`` counts these ``num_replica_retries``.
- ``RewardScorer`` (``--replicas`` replicas, each with its copy of the rewards on its own
  device) scores the videos it is sent in batches (``@serve.batch``): up to ``--max-batch-size``
  videos, from any requests and trainer ranks, waiting at most ``--batch-wait-ms`` to fill one;
  videos with the same frame shape and reward names go through one reward call. Each replica
  takes at most two batches of videos at a time, so the rest queue for the first free replica.

Batching changes which videos share a reward call, not what each video scores, for rewards that
score each video on its own (every built-in CPU reward: bitwise, the tests check it); a GPU
model's batched kernels may differ in the last bits with the batch's size, as they do in-process
with another micro-batch size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence

import numpy as np
import ray
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from starlette.requests import Request
from starlette.responses import Response

from miles.rewards.remote import WIRE_VERSION
from miles.rewards.serve_common import (
    AnswerCache,
    RequestError,
    check_auth,
    check_length,
    encode_answer,
    parse_score_body,
    score_videos,
    too_large,
)

APP_NAME = "miles-rewards"
REPLICA_LOST = (RayActorError, ActorUnavailableError)
"""What a call raises when its replica died under it: sent again to a live one."""


def server_error(e: BaseException) -> str:
    """A 500's message: the error a reward raised (a Ray task error's cause, not its traceback)."""
    cause = getattr(e, "cause", None) or e
    first = next((line for line in str(cause).splitlines() if line.strip()), "")
    return f"the server failed scoring this request (not a fault of the request): {type(cause).__name__}: {first}"


def _json(status: int, obj: object) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return Response(json.dumps(obj).encode(), status, headers, media_type="application/json")


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=1000,
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=2,
    graceful_shutdown_timeout_s=2,
)
class RewardIngress:
    """HTTP: token, limits, body checks, the answer cache, and one scorer call per video."""

    def __init__(self, scorer, hosted: Sequence[str], config: dict) -> None:
        self.scorer = scorer
        self.hosted = list(hosted)
        self.token: str | None = config["token"]
        self.max_bytes: int = config["max_bytes"]
        self.max_replica_retries: int = config["max_replica_retries"]
        self.to_drop: int = config["drop_first"]
        self.cache = AnswerCache(config["cache_size"])
        self.inflight: dict[str, asyncio.Future] = {}
        keys = ("num_requests", "num_scored_requests", "num_scored_samples", "num_cache_hits", "num_dropped")
        self.counts = dict.fromkeys((*keys, "num_errors", "num_unauthorized", "num_replica_retries"), 0)
        self.counts["max_batch_videos"] = 0  # the most videos one reward call scored (batching at work)
        self.replica_samples: dict[int, int] = {}  # scorer pid -> samples it scored (in answers)

    async def __call__(self, request: Request) -> Response:
        try:
            check_auth(request.headers.get("authorization"), self.token)
            route = (request.method, request.url.path)
            if route == ("GET", "/health"):
                return _json(200, {"status": "ok", "version": WIRE_VERSION, "rewards": self.hosted})
            if route == ("GET", "/stats"):
                return _json(200, self.stats())
            if route != ("POST", "/score"):
                raise RequestError(
                    f"no such endpoint {request.method} {request.url.path}; try "
                    "GET /health, GET /stats, POST /score",
                    404,
                )
            self.counts["num_requests"] += 1
            return await self._score(await self._read_body(request))
        except RequestError as e:
            self.counts["num_unauthorized" if e.status == 401 else "num_errors"] += 1
            return _json(e.status, {"error": str(e)})
        except Exception as e:  # a reward crashed, or every retry lost its replica: report, keep serving
            self.counts["num_errors"] += 1
            return _json(500, {"error": server_error(e)})

    def stats(self) -> dict:
        replicas = {str(pid): n for pid, n in sorted(self.replica_samples.items())}
        return dict(self.counts, engine="ray", replica_samples=replicas)

    async def _read_body(self, request: Request) -> bytes:
        check_length(request.headers.get("content-length"), self.max_bytes)
        chunks, size = [], 0
        async for chunk in request.stream():  # the declared length may lie: count what arrives
            size += len(chunk)
            if size > self.max_bytes:
                raise RequestError(too_large(size, self.max_bytes), status=413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _score(self, body: bytes) -> Response:
        frames, prompts, names, request_id = parse_score_body(body, self.hosted)
        answer = self.cache.get(request_id)
        while answer is None and request_id in self.inflight:  # a retry of a request being scored:
            await asyncio.wait([self.inflight[request_id]])  # wait for that attempt, however it ends
            answer = self.cache.get(request_id)  # None if it failed: score it here
        if answer is not None:
            self.counts["num_cache_hits"] += 1
            return Response(answer, 200, media_type="application/json")
        done = asyncio.get_running_loop().create_future()  # set when this attempt ends
        self.inflight[request_id] = done
        try:
            parts = await asyncio.gather(*(self._score_one(f, p, names) for f, p in zip(frames, prompts)))
            answer = encode_answer(request_id, {n: [part["scores"][n] for part in parts] for n in names})
            self.cache.put(request_id, answer)
        finally:
            del self.inflight[request_id]
            done.set_result(None)
        for part in parts:
            self.replica_samples[part["pid"]] = self.replica_samples.get(part["pid"], 0) + 1
            self.counts["max_batch_videos"] = max(self.counts["max_batch_videos"], part["batch"])
        self.counts["num_scored_requests"] += 1
        self.counts["num_scored_samples"] += len(prompts)
        if self.to_drop > 0:  # TEST ONLY: the answer is lost (scored and cached; the client retries)
            self.to_drop -= 1
            self.counts["num_dropped"] += 1
            return _json(503, {"error": "test fault: this answer was dropped (--fault-drop-first)"})
        return Response(answer, 200, media_type="application/json")

    async def _score_one(self, frames: np.ndarray, prompt: str, names: list[str]) -> dict:
        """One video on whichever replica is free; sent again if its replica dies under it."""
        for attempt in range(self.max_replica_retries + 1):
            try:
                part = await self.scorer.score.remote(frames, prompt, tuple(names))
            except REPLICA_LOST:
                if attempt == self.max_replica_retries:
                    raise
                self.counts["num_replica_retries"] += 1
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
                continue
            if "error" in part:
                raise RequestError(part["error"])
            return part
        raise AssertionError("unreachable")


@serve.deployment(health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=2)
class RewardScorer:
    """One replica's rewards, scoring the videos it is sent in batches."""

    def __init__(self, names: Sequence[str], options: dict, batch: dict) -> None:
        from miles.rewards.registry import build_rewards

        self.rewards = build_rewards(dict.fromkeys(names, 1.0), **options).rewards
        self.score.set_max_batch_size(batch["max_batch_size"])
        self.score.set_batch_wait_timeout_s(batch["wait_s"])
        self.hold_s = batch["hold_s"]
        self.pid = os.getpid()

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def score(
        self, frames: list[np.ndarray], prompts: list[str], names: list[tuple[str, ...]]
    ) -> list[dict]:
        """Per video ``{"scores": {name: float}, "pid": replica, "batch": videos}`` or ``{"error": message}``."""
        if self.hold_s:
            await asyncio.sleep(self.hold_s)  # TEST ONLY (--fault-hold-s): hold the batch
        # the rewards run one batch at a time, off the replica's event loop (health checks answer)
        return await asyncio.to_thread(self._score_groups, frames, prompts, names)

    def _score_groups(self, frames: list[np.ndarray], prompts: list[str], names: list[tuple]) -> list[dict]:
        groups: dict[tuple, list[int]] = {}  # one reward call per frame shape and reward list
        for i, (f, n) in enumerate(zip(frames, names)):
            groups.setdefault((f.shape, n), []).append(i)
        out: list[dict] = [{}] * len(frames)
        for (_, group_names), idx in groups.items():
            try:
                stacked = np.stack([frames[i] for i in idx])  # (b, F, H, W, 3) uint8
                scores = score_videos(self.rewards, stacked, [prompts[i] for i in idx], group_names)
                for k, i in enumerate(idx):
                    out[i] = self._part(scores, k, len(idx))
            except RequestError:  # one bad prompt must not fail its batch-mates: score each alone
                for i in idx:
                    out[i] = self._score_alone(frames[i], prompts[i], group_names)
        return out

    def _score_alone(self, frames: np.ndarray, prompt: str, names: tuple) -> dict:
        try:
            return self._part(score_videos(self.rewards, frames[None], [prompt], names), 0, 1)
        except RequestError as e:
            return {"error": str(e)}

    def _part(self, scores: dict[str, list[float]], k: int, batch: int) -> dict:
        return {"scores": {n: s[k] for n, s in scores.items()}, "pid": self.pid, "batch": batch}


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _resources(args: argparse.Namespace) -> dict:
    """A scorer replica's Ray actor options: CPUs, and one GPU (or ``--gpus-per-replica``) with cuda."""
    device = (args.device or "cpu").split(":")[0]
    if args.device and ":" in args.device:
        raise ValueError(
            f"--device {args.device}: with --engine ray each replica gets its GPU from Ray; pass "
            "--device cuda (and --gpus-per-replica; CUDA_VISIBLE_DEVICES picks the GPUs Ray may use)"
        )
    gpus = args.gpus_per_replica if args.gpus_per_replica is not None else float(device == "cuda")
    if gpus < 0 or args.cpus_per_replica < 0:
        raise ValueError("--gpus-per-replica and --cpus-per-replica must be >= 0")
    return {"num_cpus": args.cpus_per_replica, "num_gpus": gpus}


def _deployment_errors(max_lines: int = 12) -> str:
    """The end of each failed deployment's message (a replica constructor's traceback)."""
    try:
        deployments = serve.status().applications[APP_NAME].deployments.values()
    except Exception as e:  # the status is a courtesy: never hide the failure behind it
        return f"(no deployment status: {type(e).__name__}: {e})"
    lines = [line for d in deployments if d.message for line in d.message.strip().splitlines()[-max_lines:]]
    return "\n".join(lines)


def _init_ray(args: argparse.Namespace, cpus: int) -> None:
    """Join ``--ray-address``, or start a local instance of ``cpus`` CPUs without a dashboard."""
    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
    else:
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def serve_ray(args: argparse.Namespace, names: list[str], options: dict) -> int:
    """Start (or join) Ray, deploy the rewards, print the address, and serve until SIGINT / SIGTERM."""
    actor = _resources(args)
    port = args.port or _free_port(args.host)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Ray would report usage to its servers
    try:
        _init_ray(args, max(1, int(np.ceil(args.replicas * actor["num_cpus"]))))
    except Exception as e:  # Ray gives its raylet 30 s to register: a starved machine can miss it
        print(f"error: Ray did not start: {type(e).__name__}: {e}", file=sys.stderr)
        ray.shutdown()  # whatever of the local instance did start
        return 3
    signal.signal(signal.SIGTERM, _interrupt)  # a terminated server shuts Serve and Ray down
    try:
        serve.start(http_options={"host": args.host, "port": port})
        batch = {"max_batch_size": args.max_batch_size, "wait_s": args.batch_wait_ms / 1e3}
        scorer = RewardScorer.options(
            num_replicas=args.replicas, max_ongoing_requests=2 * args.max_batch_size, ray_actor_options=actor
        ).bind(names, options, dict(batch, hold_s=args.fault_hold_s))
        config = {"token": args.token, "max_bytes": int(args.max_request_mb * 2**20)}
        config.update(cache_size=args.cache_size, drop_first=args.fault_drop_first, max_replica_retries=5)
        try:
            serve.run(RewardIngress.bind(scorer, names, config), name=APP_NAME, route_prefix="/")
        except RuntimeError as e:  # a replica failed to build its rewards
            print(f"error: the reward deployment failed: {e}\n{_deployment_errors()}", file=sys.stderr)
            return 2
        print(
            f"[miles] reward server listening on http://{args.host}:{port} (rewards: {', '.join(names)}; "
            f"ray serve, {args.replicas} replica(s), batches of <= {args.max_batch_size} videos)",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        if args.ray_address:  # leave the cluster as it was; a local instance goes with its actors
            serve.delete(APP_NAME)
        ray.shutdown()
