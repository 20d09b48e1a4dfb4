"""Load test of the reward server: concurrent trainer ranks against 1, 2, 4 replicas, on loopback.

    python bench/reward_load.py --out bench/results                    # writes reward_load.json
    python bench/reward_load.py --out bench/results --replicas 1,2 --clients 4 --calls 10 --batch 4

For each replica count a server (``python -m miles.rewards.serve --engine ray``, a local Ray
instance, a shared token) is started hosting ``world_adherence``, ``sharpness`` and
``jpeg_incompressibility``; ``--clients`` threads, each its own ``remote`` reward as a trainer
rank would hold, send ``--calls`` scoring calls of ``--batch`` rendered world videos each
(9 x 64 x 64, or ``--size``), one after another; the run stops issuing calls at ``--deadline-s``.
Each call's scores are checked bitwise against the in-process reward (a mismatch is an error,
not a number). Reported per row: videos per second over the wall time of all clients, and the
p50 / p99 latency of one call (send, score on the replicas, answer). ``--engine threading`` rows
(the standard-library fallback) are added with ``--threading``. The load average is recorded
beside them: on a shared machine the absolute numbers move with the neighbours.

``run_load`` and ``ServerProcess`` are also what ``tests/unit/test_reward_service.py`` runs, at a
small size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
import torch

REPO = Path(__file__).resolve().parents[1]
HOSTED = "jpeg_incompressibility,sharpness,world_adherence"
MIX = {"jpeg_incompressibility": 0.5, "sharpness": 1.0, "world_adherence": 2.0}


@dataclass
class ServerProcess:
    """``python -m miles.rewards.serve`` in its own process group (Ray's helpers stay in it)."""

    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    url: str = ""
    output: list[str] = field(default_factory=list)

    def start(self, timeout_s: float = 240.0, attempts: int = 2) -> ServerProcess:
        """Start it and wait for its address; a Ray that timed out starting (exit 3, a starved
        machine) is started again, ``attempts`` times in all."""
        for attempt in range(1, attempts + 1):
            try:
                return self._start(timeout_s)
            except RuntimeError:
                if self.proc.returncode != 3 or attempt == attempts:
                    raise
                self.output.append(f"[reward_load] attempt {attempt}: Ray did not start; trying again\n")
        raise AssertionError("unreachable")

    def _start(self, timeout_s: float) -> ServerProcess:
        cmd = [sys.executable, "-m", "miles.rewards.serve", *self.args]
        env = {**os.environ, "PYTHONPATH": str(REPO), **self.env}
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        for line in self.proc.stdout:
            self.output.append(line)
            match = re.search(r"reward server listening on (http://\S+)", line)
            if match:
                self.url = match.group(1)
                threading.Thread(target=self._drain, daemon=True).start()
                return self
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError(
            f"the reward server did not start (rc {self.proc.returncode}):\n{''.join(self.output)}"
        )

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    def stats(self, token: str | None = None) -> dict:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return requests.get(self.url + "/stats", headers=headers, timeout=10).json()

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (Serve and Ray shut down), then SIGKILL to the whole group if it lingers."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # Ray's agents, if any outlived the driver
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        return self.proc.returncode


def world_videos(batch: int, seed: int, size: int = 64) -> tuple[torch.Tensor, list[str]]:
    """``batch`` rendered world videos (B, 9, 3, size, size), already k/255 values, and their prompts."""
    from miles.rewards import frames_to_uint8
    from miles.rewards.remote import dequantize_frames
    from miles.world import render_prompt, train_prompts

    prompts = train_prompts()
    chosen = [prompts[(seed * 7 + i) % len(prompts)] for i in range(batch)]
    videos = torch.stack([render_prompt(p, seed=seed * 100 + i) for i, p in enumerate(chosen)])
    if size != videos.shape[-1]:
        videos = torch.nn.functional.interpolate(videos.flatten(0, 1), size=(size, size)).unflatten(
            0, videos.shape[:2]
        )
    return dequantize_frames(frames_to_uint8(videos)), chosen


def call_seed(client: int, call: int) -> int:
    return 1000 * client + call


def reference_scores(
    clients: int, calls: int, batch: int, size: int = 64
) -> dict[tuple[int, int], torch.Tensor]:
    """The in-process mix of every call's videos: what the server must answer, bitwise."""
    from miles.rewards import build_rewards

    mix = build_rewards(MIX)
    return {
        (c, k): mix(*world_videos(batch, call_seed(c, k), size))[0]
        for c in range(clients)
        for k in range(calls)
    }


def run_load(
    url: str,
    *,
    clients: int,
    calls: int,
    batch: int,
    deadline_s: float,
    token: str | None = None,
    size: int = 64,
    remote_options: dict | None = None,
) -> dict:
    """``clients`` threads (trainer ranks), each ``calls`` scoring calls of ``batch`` videos, one after
    another, until done or ``deadline_s``. Returns latencies, throughput and every call's scores."""
    from miles.rewards import build_rewards

    options = {
        "url": url,
        "rewards": MIX,
        "token": token,
        "retries": 3,
        "backoff_s": 0.2,
        "timeout_s": 120.0,
        **(remote_options or {}),
    }
    rewards = [build_rewards({"remote": 1.0}, {"remote": options}) for _ in range(clients)]
    inputs = {
        (c, k): world_videos(batch, call_seed(c, k), size) for c in range(clients) for k in range(calls)
    }
    scores: dict[tuple[int, int], torch.Tensor] = {}
    latencies: list[float] = []
    errors: list[str] = []
    start = time.perf_counter()
    stop_at = start + deadline_s

    def client(c: int) -> None:
        for k in range(calls):
            if time.perf_counter() > stop_at:
                return
            t = time.perf_counter()
            try:
                scores[(c, k)] = rewards[c](*inputs[(c, k)])[0]
            except Exception as e:  # reported, not raised: the other ranks go on
                errors.append(f"client {c} call {k}: {type(e).__name__}: {e}")
                return
            latencies.append(time.perf_counter() - t)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else latencies * 99
    return {
        "clients": clients,
        "calls_per_client": calls,
        "batch": batch,
        "num_calls": len(scores),
        "num_videos": batch * len(scores),
        "complete": len(scores) == clients * calls,
        "errors": errors,
        "wall_s": wall,
        "videos_per_s": batch * len(scores) / wall,
        "p50_ms": 1e3 * q[49] if q else None,
        "p99_ms": 1e3 * q[98] if q else None,
        "client_retries": sum(r.rewards["remote"].stats()["num_retries"] for r in rewards),
        "scores": scores,
    }


def bitwise_mismatches(scores: dict, reference: dict) -> list[tuple[int, int]]:
    return [
        key
        for key, s in scores.items()
        if not torch.equal(s.view(torch.int32), reference[key].view(torch.int32))
    ]


def _row(args: argparse.Namespace, engine: str, replicas: int, reference: dict) -> dict:
    token = "bench-" + os.urandom(8).hex()
    server_args = [
        "--rewards",
        HOSTED,
        "--port",
        "0",
        "--engine",
        engine,
        "--max-batch-size",
        str(args.max_batch_size),
    ]
    if engine == "ray":
        server_args += ["--replicas", str(replicas)]
    server = ServerProcess(server_args, env={"MILES_REWARD_TOKEN": token}).start()
    try:
        run_load(server.url, clients=1, calls=1, batch=args.batch, deadline_s=60, token=token, size=args.size)
        result = run_load(
            server.url,
            clients=args.clients,
            calls=args.calls,
            batch=args.batch,
            deadline_s=args.deadline_s,
            token=token,
            size=args.size,
        )
        stats = server.stats(token)
    finally:
        server.stop()
    mismatches = bitwise_mismatches(result.pop("scores"), reference)
    if mismatches or not result["complete"]:
        raise RuntimeError(f"{engine} x{replicas}: mismatches {mismatches}, errors {result['errors']}")
    return {"engine": engine, "replicas": replicas, **result, "server_stats": stats}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--replicas", default="1,2,4", help="comma-separated replica counts")
    p.add_argument("--clients", type=int, default=4, help="concurrent trainer ranks")
    p.add_argument("--calls", type=int, default=10, help="scoring calls per client")
    p.add_argument("--batch", type=int, default=4, help="videos per call")
    p.add_argument("--size", type=int, default=64, help="frame side (the world renders 64)")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--deadline-s", type=float, default=300.0)
    p.add_argument("--threading", action="store_true", help="add a row for --engine threading")
    args = p.parse_args()
    torch.set_num_threads(1)
    reference = reference_scores(args.clients, args.calls, args.batch, args.size)
    rows = [_row(args, "threading", 1, reference)] if args.threading else []
    rows += [_row(args, "ray", int(n), reference) for n in args.replicas.split(",")]
    out = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": os.getloadavg()},
        "rewards": MIX,
        "frames": [9, 3, args.size, args.size],
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reward_load.json").write_text(json.dumps(out, indent=1))
    print(
        f"{'engine':<10} {'replicas':>8} {'videos/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'replica retries':>16}"
    )
    for r in rows:
        retries = r["server_stats"].get("num_replica_retries", 0)
        print(
            f"{r['engine']:<10} {r['replicas']:>8} {r['videos_per_s']:>9.1f} {r['p50_ms']:>8.0f} "
            f"{r['p99_ms']:>8.0f} {retries:>16}"
        )
    print(f"load average {os.getloadavg()}; wrote {args.out / 'reward_load.json'}")


if __name__ == "__main__":
    main()
