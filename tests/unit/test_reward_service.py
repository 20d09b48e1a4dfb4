"""The reward server on Ray Serve (``--engine ray``, the default), over loopback.

One server starts for the module (a local Ray instance: 20-40 s on 2 cores, more when they are
shared), hosting the download-free ``jpeg_incompressibility``, ``sharpness`` and
``world_adherence`` behind a token: 2 replicas, batches of <= 2 videos (a replica holds <= 4, so
a call of 8 videos must use both), a 1 MiB body limit, and each batch held 0.3 s before scoring
(``--fault-hold-s``, test only) so that work is in flight when a replica is killed and a retried
request id races its original.

Scores are compared bitwise with the in-process reward, under a small load of 4 concurrent
clients (``bench/reward_load.run_load``); the token, the limits and malformed or hostile bodies
are refused with 4xx and the server goes on scoring; a request id sent three times is scored
once; and, last, one replica process is SIGKILLed while 4 clients are mid-run: every call's
scores equal the in-process reward bitwise, and ``/stats`` shows each request and sample
committed once, the killed replica's videos sent again.

Ray is a test dependency (``make setup`` installs ``.[dev]``, which pulls ``ray[serve]``): without
it these tests fail at import, they do not skip.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import ray  # noqa: F401 (fail, not skip, when the serving engine is missing)
import requests
import torch

from bench.reward_load import HOSTED, MIX, ServerProcess, bitwise_mismatches, reference_scores, run_load
from miles.rewards import build_rewards, frames_to_uint8
from miles.rewards.remote import check_reward_server, encode_request

TOKEN = "test-token-" + os.urandom(6).hex()
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    args = ["--rewards", HOSTED, "--port", "0", "--replicas", "2", "--max-batch-size", "2"]
    args += ["--max-request-mb", "1", "--fault-hold-s", "0.3"]
    proc = ServerProcess(args, env={"MILES_REWARD_TOKEN": TOKEN})
    try:
        yield proc.start()
    finally:
        proc.stop()


def remote(url: str, **options: object):
    options = {
        "url": url,
        "rewards": MIX,
        "token": TOKEN,
        "retries": 2,
        "backoff_s": 0.1,
        "timeout_s": 60.0,
        **options,
    }
    return build_rewards({"remote": 1.0}, {"remote": options})


def test_scores_bitwise_split_over_replicas_and_batched_across_clients(server) -> None:
    assert check_reward_server(server.url, MIX, TOKEN) == HOSTED.split(",")  # the trainer's preflight
    ref = reference_scores(clients=4, calls=3, batch=3)
    before = server.stats(TOKEN)
    result = run_load(server.url, clients=4, calls=3, batch=3, deadline_s=120, token=TOKEN)
    print({k: v for k, v in result.items() if k != "scores"})  # throughput, p50 / p99 (with the 0.3 s hold)
    assert result["complete"] and not result["errors"], result["errors"]
    assert bitwise_mismatches(result["scores"], ref) == []
    assert len(result["scores"]) == 12 and result["client_retries"] == 0
    stats = server.stats(TOKEN)
    assert stats["engine"] == "ray" and stats["num_replica_retries"] == 0
    assert stats["num_scored_samples"] - before["num_scored_samples"] == 36
    assert 1 < stats["max_batch_videos"] <= 2  # videos of different requests shared reward calls
    # one call of 8 videos: a replica holds at most 4, so the engine spreads it over both
    videos, prompts = zip(*(reference_videos(s) for s in range(8)))
    reward = remote(server.url)
    got, _ = reward(torch.cat(videos), sum(prompts, []))
    want, _ = build_rewards(MIX)(torch.cat(videos), sum(prompts, []))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    after = server.stats(TOKEN)["replica_samples"]
    assert len(after) == 2 and all(after[pid] > stats["replica_samples"].get(pid, 0) for pid in after)


def reference_videos(seed: int) -> tuple[torch.Tensor, list[str]]:
    from bench.reward_load import world_videos

    return world_videos(1, 500 + seed)


def test_token_is_required_everywhere(server) -> None:
    url = server.url
    body = encode_request(
        np.zeros((1, 2, 8, 8, 3), np.uint8), ["a big red ball moving left"], ["sharpness"], "t1"
    )
    for method, path, data in [("GET", "/health", None), ("GET", "/stats", None), ("POST", "/score", body)]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            r = requests.request(method, url + path, data=data, headers=headers, timeout=30)
            assert r.status_code == 401 and "token" in r.json()["error"], (path, headers, r.text)
    assert requests.get(url + "/health", headers=AUTH, timeout=30).status_code == 200
    with pytest.raises(ValueError, match="refused this client's token.*MILES_REWARD_TOKEN"):
        check_reward_server(url, MIX, token="wrong")
    with pytest.raises(ValueError, match=r"does not host \['pickscore'\]"):
        check_reward_server(url, ["pickscore"], token=TOKEN)
    assert server.stats(TOKEN)["num_unauthorized"] >= 9


def test_malformed_oversized_and_hostile_payloads_get_4xx_and_harm_nothing(server, tmp_path) -> None:
    url = server.url
    frames = frames_to_uint8(reference_videos(0)[0])
    prompt = ["a big red ball moving left"]
    marker = tmp_path / "pwned"
    cases = {
        "not safetensors": (b"\x00" * 64, 400, "malformed"),
        "huge header length": (b"\xff" * 8 + b"{}", 400, "malformed"),
        "path as request id": (
            encode_request(frames, prompt, ["sharpness"], "../../etc/passwd"),
            400,
            "request_id",
        ),
        "shell in request id": (
            encode_request(frames, prompt, ["sharpness"], f"x;touch {marker}"),
            400,
            "request_id",
        ),
        "unhosted reward": (encode_request(frames, prompt, ["__import__('os')"], "r1"), 400, "does not host"),
        "prompt outside the grammar": (
            encode_request(frames, ["$(touch /tmp/x)"], ["world_adherence"], "r2"),
            400,
            "grammar",
        ),
        "float frames": (
            encode_request(frames.astype(np.float32), prompt, ["sharpness"], "r3"),
            400,
            "uint8",
        ),
        "zero frames (a 500 with a Ray task traceback before)": (
            encode_request(np.zeros((1, 0, 64, 64, 3), np.uint8), prompt, ["world_adherence"], "r5"),
            400,
            "at least one frame",
        ),
        "no video": (
            encode_request(np.zeros((0, 9, 64, 64, 3), np.uint8), [], ["sharpness"], "r6"),
            400,
            "video",
        ),
        "frames too small for a reward": (
            encode_request(np.zeros((1, 9, 1, 1, 3), np.uint8), prompt, ["world_adherence"], "r7"),
            400,
            "too small",
        ),
        "metadata not JSON": (
            encode_request(frames, prompt, ["sharpness"], "r8").replace(b'"prompts":"[', b'"prompts":"{'),
            400,
            "malformed",
        ),
        "over 1 MiB": (
            encode_request(np.zeros((4, 9, 128, 128, 3), np.uint8), prompt * 4, ["sharpness"], "r4"),
            413,
            "--max-request-mb",
        ),
    }
    for name, (body, status, message) in cases.items():
        r = requests.post(url + "/score", data=body, headers=AUTH, timeout=60)
        assert r.status_code == status and message in r.json()["error"], (name, r.status_code, r.text)
    chunked = requests.post(
        url + "/score", data=iter([b"abc"]), headers=AUTH, timeout=60
    )  # no Content-Length
    assert chunked.status_code == 411
    assert requests.get(url + "/etc/passwd", headers=AUTH, timeout=30).status_code == 404
    assert not marker.exists()
    videos, prompts = reference_videos(1)  # the server is unharmed: still bitwise
    got, _ = remote(url)(videos, prompts)
    assert torch.equal(got, build_rewards(MIX)(videos, prompts)[0])


def test_a_request_id_is_scored_once(server) -> None:
    """The same request sent three times, two at once (a retry racing its original): one scoring,
    three equal answers, two from the cache (or the in-flight attempt)."""
    videos, prompts = reference_videos(2)
    body = encode_request(frames_to_uint8(videos), prompts, list(MIX), "same-id-1")
    before = server.stats(TOKEN)
    answers: list[bytes] = []

    def post() -> None:
        answers.append(requests.post(server.url + "/score", data=body, headers=AUTH, timeout=60).content)

    threads = [threading.Thread(target=post) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    post()
    after = server.stats(TOKEN)
    assert len(answers) == 3 and len(set(answers)) == 1, answers
    assert after["num_scored_samples"] - before["num_scored_samples"] == len(prompts)
    assert after["num_cache_hits"] - before["num_cache_hits"] == 2
    scores = json.loads(answers[0])["scores"]
    want = build_rewards(MIX)(videos, prompts)[1]
    for name in MIX:
        assert torch.equal(torch.tensor(scores[name], dtype=torch.float32), want[name])


def test_replica_killed_mid_run_every_sample_scored_once(server) -> None:
    clients, calls, batch = 4, 3, 4
    ref = reference_scores(clients, calls, batch)
    box: dict = {}

    def load() -> None:
        box["result"] = run_load(
            server.url, clients=clients, calls=calls, batch=batch, deadline_s=240, token=TOKEN
        )

    before = server.stats(TOKEN)
    thread = threading.Thread(target=load)
    thread.start()
    while True:  # mid-run: both replicas have answered, 40 of the 48 videos still to go
        stats = server.stats(TOKEN)
        if (
            len(stats["replica_samples"]) == 2
            and stats["num_scored_samples"] - before["num_scored_samples"] >= 8
        ):
            break
        assert thread.is_alive(), "the load finished before the kill"
        time.sleep(0.05)
    # each replica holds a batch (0.3 s) with its next one queued: killing one loses work in flight
    os.kill(min(int(pid) for pid in stats["replica_samples"]), signal.SIGKILL)
    thread.join()
    result = box["result"]
    assert result["complete"] and not result["errors"], result["errors"]
    assert bitwise_mismatches(result["scores"], ref) == []
    after = server.stats(TOKEN)
    print({k: v for k, v in result.items() if k != "scores"}, after)
    delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
    assert delta["num_replica_retries"] >= 1  # the killed replica's videos were sent again
    assert delta["num_scored_requests"] == clients * calls and delta["num_cache_hits"] == 0  # committed once
    scored = sum(after["replica_samples"].values()) - sum(before["replica_samples"].values())
    assert delta["num_scored_samples"] == scored == clients * calls * batch
    assert result["client_retries"] == 0 and delta["num_errors"] == 0  # the engine hid the loss
