"""The ``remote`` reward against a real reward server, and ``vlm_judge`` against a fake VLM, over loopback.

The reward server runs as ``python -m miles.rewards.serve --engine threading`` (the
standard-library fallback, which starts in a second; the Ray Serve engine has its own tests in
``test_reward_service.py``) in a subprocess hosting the
download-free rewards; remote scores are compared bitwise with in-process scores of the same
uint8-quantised frames (``dequantize_frames(frames_to_uint8(videos))``, what the server scores).
Faults are real: the server is killed between batches and restarted, and its test-only
``--fault-drop-first`` loses answers so that the client's retry must be answered from the cache
(each sample scored exactly once, per ``/stats``). Bad answers (not JSON, wrong count, HTTP
errors) and the VLM judge's endpoint come from small ``http.server`` fakes in this file.
"""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from PIL import Image

from miles.rewards import RemoteRewardError, build_rewards, frames_to_uint8, sample_frame_indices
from miles.rewards.remote import decode_request, dequantize_frames, encode_request
from miles.rewards.vlm_judge import parse_score
from miles.world import render_prompt, train_prompts

REPO = Path(__file__).resolve().parents[2]
HOSTED = "jpeg_incompressibility,sharpness,world_adherence"
MIX = {"jpeg_incompressibility": 0.5, "sharpness": 1.0, "world_adherence": 2.0}
FAST = {"retries": 1, "backoff_s": 0.01, "timeout_s": 30.0}


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape, (a, b)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (a.tolist(), b.tolist())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def stats(self) -> dict:
        return requests.get(self.url + "/stats", timeout=5).json()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc.stdout.close()


def start_server(*args: str, port: int = 0) -> Server:
    """``python -m miles.rewards.serve`` on ``port`` (0: a free one); returns once it listens."""
    cmd = [sys.executable, "-m", "miles.rewards.serve", "--rewards", HOSTED, "--port", str(port)]
    cmd += ["--engine", "threading", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    for line in proc.stdout:
        output.append(line)
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            return Server(proc, match.group(1))
    proc.wait(timeout=10)
    raise AssertionError(f"the reward server did not start (rc {proc.returncode}):\n{''.join(output)}")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server()
    yield s
    s.kill()


def world_batch(batch: int = 6, seed: int = 0) -> tuple[torch.Tensor, list[str]]:
    """Rendered world videos (B, 9, 3, 64, 64) with float noise (not uint8-representable), and prompts."""
    prompts = train_prompts()[:batch]
    videos = torch.stack([render_prompt(p, seed=i) for i, p in enumerate(prompts)])
    noise = torch.randn(videos.shape, generator=torch.Generator().manual_seed(seed))
    return (videos + 0.05 * noise).clamp(0.0, 1.0), prompts


def quantized(videos: torch.Tensor) -> torch.Tensor:
    return dequantize_frames(frames_to_uint8(videos))


def test_quantisation_round_trip_and_wire_format() -> None:
    u = np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16, 1).repeat(3, axis=-1)
    assert np.array_equal(frames_to_uint8(dequantize_frames(u)), u)
    frames = frames_to_uint8(world_batch(2)[0])
    body = encode_request(frames, ["a", "b ✓"], ["sharpness"], "id-1")
    got, prompts, names, request_id = decode_request(body)
    assert np.array_equal(got, frames) and prompts == ["a", "b ✓"] and names == ["sharpness"]
    assert request_id == "id-1"
    with pytest.raises(ValueError, match="malformed"):
        decode_request(b"not safetensors")


def test_remote_mix_equals_in_process_bitwise(server: Server) -> None:
    videos, prompts = world_batch()
    videos = quantized(videos)  # exact k/255 values: every reward sees the same frames
    remote = build_rewards({"remote": 1.0}, {"remote": dict(url=server.url, rewards=MIX, **FAST)})
    combined, per_reward = remote(videos, prompts)
    want, want_per = build_rewards(MIX)(videos, prompts)
    assert_bitwise(combined, want)
    assert_bitwise(per_reward["remote"], want)
    for name in MIX:
        assert_bitwise(remote.rewards["remote"].last_scores[name], want_per[name])
    assert want_per["world_adherence"].min() > 0.5  # a meaningful comparison: rendered ground truth
    assert remote.rewards["remote"].stats() == {"num_requests": 1, "num_retries": 0, "num_samples": 6}


def test_float_frames_jpeg_exact_float_rewards_see_quantised_frames(server: Server) -> None:
    videos, prompts = world_batch(4, seed=1)
    names = ["jpeg_incompressibility", "sharpness"]
    remote = build_rewards({"remote": 1.0}, {"remote": dict(url=server.url, rewards=names, **FAST)})
    remote(videos, prompts)
    got = remote.rewards["remote"].last_scores
    # JPEG quantises frames itself: the remote score is the in-process score of the float videos
    _, original = build_rewards(dict.fromkeys(names, 1.0))(videos, prompts)
    assert_bitwise(got["jpeg_incompressibility"], original["jpeg_incompressibility"])
    # sharpness reads floats: remote equals in-process on the quantised frames, not the originals
    _, on_quantised = build_rewards({"sharpness": 1.0})(quantized(videos), prompts)
    assert_bitwise(got["sharpness"], on_quantised["sharpness"])
    assert not torch.equal(got["sharpness"], original["sharpness"])


def test_batches_and_frame_subsampling(server: Server) -> None:
    videos, prompts = world_batch(5, seed=2)
    names = ["jpeg_incompressibility", "sharpness"]
    before = server.stats()["num_scored_requests"]
    remote = build_rewards(
        {"remote": 1.0},
        {
            "remote": dict(
                url=server.url,
                rewards=names,
                batch_size=2,
                num_frames=4,  # the server's rewards sample 4 of these 4: the same frames as in-process
                **FAST,
            )
        },
    )
    combined, _ = remote(videos, prompts)
    want, _ = build_rewards(dict.fromkeys(names, 1.0))(quantized(videos), prompts)
    assert_bitwise(combined, want)
    assert server.stats()["num_scored_requests"] - before == 3  # 2 + 2 + 1 videos


def test_missing_server_is_refused_in_the_constructor() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=re.escape(f"{url}/health")) as e:
        build_rewards({"remote": 1.0}, {"remote": dict(url=url, **FAST)})
    assert "python -m miles.rewards.serve" in str(e.value)


def test_dry_run_and_trainer_check_the_server_before_building(server: Server) -> None:
    """``check_reward_config`` (the dry run's check, and the trainer's before the model loads) asks
    the server: a missing server and an unhosted reward are refused without building a reward."""
    from miles.config import RewardConfig
    from miles.rewards.from_config import check_reward_config
    from miles.rewards.remote import RemoteOptions

    options = dict(retries=1, backoff_s=0.01, timeout_s=10.0)
    missing = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=re.escape(f"{missing}/health") + ".*after 2 attempt"):
        check_reward_config(
            RewardConfig(weights={"remote": 1.0}, remote=RemoteOptions(url=missing, **options))
        )
    unhosted = RemoteOptions(url=server.url, rewards={"pickscore": 1.0}, **options)
    with pytest.raises(ValueError, match=r"does not host \['pickscore'\]"):
        check_reward_config(RewardConfig(weights={"remote": 1.0}, remote=unhosted))
    check_reward_config(
        RewardConfig(weights={"remote": 1.0}, remote=RemoteOptions(url=server.url, **options))
    )


def test_unhosted_reward_and_bad_prompt_are_refused(server: Server) -> None:
    with pytest.raises(ValueError, match=r"does not host \['pickscore'\]"):
        build_rewards({"remote": 1.0}, {"remote": dict(url=server.url, rewards=["pickscore"], **FAST)})
    remote = build_rewards(
        {"remote": 1.0}, {"remote": dict(url=server.url, rewards=["world_adherence"], **FAST)}
    )
    videos, prompts = world_batch(2)
    with pytest.raises(RemoteRewardError, match=r"HTTP 400 \(not retried\).*a purple cube"):
        remote(videos, [prompts[0], "a purple cube"])
    assert remote.rewards["remote"].stats()["num_retries"] == 0


def test_server_killed_between_batches_then_restarted() -> None:
    server = start_server()
    try:
        remote = build_rewards({"remote": 1.0}, {"remote": dict(url=server.url, rewards=MIX, **FAST)})
        videos, prompts = world_batch(3)
        videos = quantized(videos)
        want, _ = build_rewards(MIX)(videos, prompts)
        assert_bitwise(remote(videos, prompts)[0], want)
        server.kill()
        with pytest.raises(RemoteRewardError, match=re.escape(f"{server.url}/score") + ".*after 2 attempt"):
            remote(videos, prompts)
        server = start_server(port=server.port)
        assert_bitwise(remote(videos, prompts)[0], want)  # the same client resumes
        assert server.stats()["num_scored_samples"] == 3
    finally:
        server.kill()


def test_server_killed_mid_call_and_restarted_while_the_client_retries() -> None:
    """One scoring call of 4 requests: the server dies after the second answer and comes back on
    the same port while the client is retrying the third; the call completes, bitwise."""
    server = start_server()
    box = {"server": server}
    try:
        options = dict(retries=8, backoff_s=0.25, timeout_s=30.0, batch_size=1)
        remote = build_rewards({"remote": 1.0}, {"remote": dict(url=server.url, rewards=MIX, **options)})
        client = remote.rewards["remote"]
        videos, prompts = world_batch(4)
        videos = quantized(videos)
        want, _ = build_rewards(MIX)(videos, prompts)
        score_batch, answered = client._score_batch, []

        def restart() -> None:
            box["server"] = start_server(port=server.port)

        def kill_after_two(frames, batch_prompts):
            out = score_batch(frames, batch_prompts)
            answered.append(len(batch_prompts))
            if len(answered) == 2:
                server.kill()
                box["thread"] = threading.Thread(target=restart)
                box["thread"].start()
            return out

        client._score_batch = kill_after_two
        got, _ = remote(videos, prompts)
        box["thread"].join()
        assert_bitwise(got, want)
        assert client.stats()["num_retries"] >= 1 and client.stats()["num_samples"] == 4
        assert box["server"].stats()["num_scored_samples"] == 2  # the restarted server scored the rest
    finally:
        if "thread" in box:
            box["thread"].join()
        box["server"].kill()


def test_lost_answers_are_retried_and_each_sample_scored_once() -> None:
    server = start_server("--fault-drop-first", "2")
    try:
        remote = build_rewards(
            {"remote": 1.0}, {"remote": dict(url=server.url, rewards=MIX, batch_size=3, **FAST)}
        )
        videos, prompts = world_batch(6)
        videos = quantized(videos)
        combined, _ = remote(videos, prompts)
        assert_bitwise(combined, build_rewards(MIX)(videos, prompts)[0])
        stats = server.stats()
        assert stats["num_dropped"] == 2 and stats["num_cache_hits"] == 2
        assert stats["num_scored_requests"] == 2 and stats["num_scored_samples"] == 6
        assert remote.rewards["remote"].stats() == {"num_requests": 2, "num_retries": 2, "num_samples": 6}
    finally:
        server.kill()


def test_threading_engine_token_and_limits(monkeypatch) -> None:
    """The fallback engine's checks are the Ray engine's: 401 without the token, 413 over the limit,
    400 for a hostile request id; the client sends ``$MILES_REWARD_TOKEN``."""
    monkeypatch.setenv("MILES_REWARD_TOKEN", "s3cret")  # the server inherits it, so does the client
    server = start_server("--max-request-mb", "0.5")
    try:
        frames = frames_to_uint8(world_batch(1)[0])
        body = encode_request(frames, ["a big red ball moving left"], ["sharpness"], "a;rm -rf /")
        for headers in ({}, {"Authorization": "Bearer nope"}):
            r = requests.post(server.url + "/score", data=body, headers=headers, timeout=10)
            assert r.status_code == 401 and "MILES_REWARD_TOKEN" in r.json()["error"]
        auth = {"Authorization": "Bearer s3cret"}
        r = requests.post(server.url + "/score", data=body, headers=auth, timeout=10)
        assert r.status_code == 400 and "request_id" in r.json()["error"]
        big = encode_request(np.zeros((8, 9, 64, 64, 3), np.uint8), ["x"] * 8, ["sharpness"], "big")
        assert requests.post(server.url + "/score", data=big, headers=auth, timeout=10).status_code == 413
        videos, prompts = world_batch(2)
        got, _ = build_rewards({"remote": 1.0}, {"remote": dict(url=server.url, rewards=MIX, **FAST)})(
            videos, prompts
        )
        assert_bitwise(got, build_rewards(MIX)(quantized(videos), prompts)[0])
        monkeypatch.delenv("MILES_REWARD_TOKEN")
        with pytest.raises(ValueError, match="refused this client's token"):
            build_rewards({"remote": 1.0}, {"remote": dict(url=server.url, **FAST)})
    finally:
        server.kill()


def test_non_loopback_bind_without_token_is_refused(monkeypatch, capsys) -> None:
    from miles.rewards import serve

    monkeypatch.delenv("MILES_REWARD_TOKEN", raising=False)
    for engine in ("threading", "ray"):  # refused before any reward or Ray starts
        assert serve.main(["--rewards", "sharpness", "--host", "0.0.0.0", "--engine", engine]) == 2
        assert "refusing to serve on 0.0.0.0 without a token" in capsys.readouterr().err


def start_fake(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


class _JsonHandler(BaseHTTPRequestHandler):
    def reply(self, status: int, body: bytes | dict) -> None:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


BAD_ANSWERS = {
    "not_json": (200, b"<html>oops</html>", "not JSON"),
    "wrong_count": (
        200,
        {"scores": {"sharpness": [1.0]}},
        "returned 1 scores for reward 'sharpness'; expected 2",
    ),
    "wrong_id": (200, {"request_id": "other", "scores": {}}, "expected {'request_id'"),
    "http_404": (404, {"error": "gone"}, r"HTTP 404 \(not retried\): gone"),
    "http_503": (503, {"error": "overloaded"}, "after 2 attempt.*HTTP 503: overloaded"),
}


@pytest.mark.parametrize("mode", list(BAD_ANSWERS))
def test_bad_answers_name_the_url(mode: str) -> None:
    status, body, message = BAD_ANSWERS[mode]
    calls = []

    class Handler(_JsonHandler):
        def do_GET(self) -> None:
            self.reply(200, {"status": "ok", "version": 1, "rewards": ["sharpness"]})

        def do_POST(self) -> None:
            request = self.rfile.read(int(self.headers["Content-Length"]))
            calls.append(decode_request(request)[3])
            answer = (
                dict(body, request_id=body.get("request_id", calls[-1])) if isinstance(body, dict) else body
            )
            self.reply(status, answer)

    for url in start_fake(Handler):
        remote = build_rewards({"remote": 1.0}, {"remote": dict(url=url, **FAST)})
        with pytest.raises(RemoteRewardError, match=re.escape(f"{url}/score") + f".*{message}"):
            remote(*world_batch(2))
    assert len(calls) == (2 if mode == "http_503" else 1) and len(set(calls)) == 1  # one id per batch


# ---------------------------------------------------------------------------------------------
# vlm_judge against a fake OpenAI-compatible server

SCRIPT = {  # prompt -> answers for its successive attempts: (HTTP status, content)
    "a red ball": [(200, "The ball is red and moves left.\nScore: 4")],
    "a bare number": [(200, " 5. ")],
    "an unparsable answer": [(200, "I cannot rate this video.")],
    "a flaky server": [(500, None), (200, "Reasoning: fine. Final Score = **2.5**")],
    "out of range": [(200, "Score: 7")],
}
EXPECTED = [0.75, 1.0, None, 0.375, None]  # (s - 1) / 4 on the 1..5 scale; None: unparsable


@dataclass
class FakeVLM:
    url: str
    requests: list[dict]
    headers: list[dict]


@pytest.fixture
def fake_vlm() -> Iterator[FakeVLM]:
    script = {k: list(v) for k, v in SCRIPT.items()}
    lock = threading.Lock()
    fake = FakeVLM("", [], [])

    class Handler(_JsonHandler):
        def do_GET(self) -> None:
            ok = self.path == "/v1/models"
            self.reply(200 if ok else 404, {"object": "list", "data": [{"id": "fake-vl"}]} if ok else {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = body["messages"][0]["content"][-1]["text"]
            prompt = re.search(r'prompt: "(.*?)"', text).group(1)
            with lock:
                fake.requests.append(body)
                fake.headers.append(dict(self.headers))
                status, content = script[prompt].pop(0)
            if status != 200:
                self.reply(status, {"error": "scripted failure"})
                return
            self.reply(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})

    for url in start_fake(Handler):
        fake.url = url
        yield fake


def vlm(url: str, **options: object):
    options = {"url": url, "retries": 2, "backoff_s": 0.01, "timeout_s": 10.0, **options}
    return build_rewards({"vlm_judge": 1.0}, {"vlm_judge": options}).rewards["vlm_judge"]


def random_videos(batch: int) -> torch.Tensor:
    return torch.rand(batch, 9, 3, 16, 16, generator=torch.Generator().manual_seed(0))


def test_parse_score() -> None:
    cases = {
        "Score: 4": 0.75,
        "score=1": 0.0,
        "Looks good (4 balls).\nFinal Score: **5**": 1.0,
        "Score: 2\nCorrected score: 3": 0.5,
        "3": 0.5,
        "  4.5 ": 0.875,
        "The video scores well": None,
        "4 out of 5": None,
        "Score: 6": None,
        "Score: 0": None,
    }
    for answer, want in cases.items():
        assert parse_score(answer, 1.0, 5.0) == want, answer
    assert parse_score("Score: 7", 0.0, 10.0) == 0.7


def test_vlm_judge_scores_retries_and_counts_unparsable(fake_vlm: FakeVLM, monkeypatch) -> None:
    monkeypatch.setenv("MILES_VLM_API_KEY", "sekrit")
    judge = vlm(fake_vlm.url, unparsable="min", num_frames=4)
    assert judge.model == "fake-vl"  # the only model /v1/models lists
    videos, prompts = random_videos(5), list(SCRIPT)
    scores = judge(videos, prompts)
    assert scores.tolist() == [0.0 if e is None else e for e in EXPECTED]
    assert judge.stats() == {"num_requests": 5, "num_retries": 1, "num_unparsable": 2, "last_unparsable": 2}
    assert len(fake_vlm.requests) == 6  # the HTTP 500 was retried once
    idx = sample_frame_indices(9, 4)
    frames = frames_to_uint8(videos[:, idx])
    for body, headers in zip(fake_vlm.requests, fake_vlm.headers):
        assert headers["Authorization"] == "Bearer sekrit"
        assert body["model"] == "fake-vl" and body["temperature"] == 0.0
        *images, question = body["messages"][0]["content"]
        i = prompts.index(re.search(r'prompt: "(.*?)"', question["text"]).group(1))
        assert len(images) == 4 and "from 1 (worst) to 5 (best)" in question["text"]
        for part, frame in zip(images, frames[i]):
            header, data = part["image_url"]["url"].split(",", 1)
            assert header == "data:image/png;base64"
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(base64.b64decode(data)))), frame)


def test_vlm_judge_unparsable_error_is_the_default(fake_vlm: FakeVLM) -> None:
    judge = vlm(fake_vlm.url, model="fake-vl")
    with pytest.raises(RemoteRewardError, match="2 unparsable answer.*I cannot rate this video"):
        judge(random_videos(5), list(SCRIPT))
    assert judge.stats()["num_unparsable"] == 2


def test_vlm_judge_refuses_bad_setup(fake_vlm: FakeVLM) -> None:
    with pytest.raises(ValueError, match=r"'qwen' is not served.*\['fake-vl'\]"):
        vlm(fake_vlm.url, model="qwen")
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=re.escape(f"{url}/v1/models")):
        vlm(url)
    with pytest.raises(ValueError, match=r"vlm_judge\.question must contain"):
        vlm(fake_vlm.url, question="Rate it.")
    with pytest.raises(ValueError, match=r"vlm_judge\.score_range"):
        vlm(fake_vlm.url, score_range=[5, 1])


def test_vlm_judge_gives_up_after_retries(fake_vlm: FakeVLM) -> None:
    judge = vlm(fake_vlm.url, retries=0)
    with pytest.raises(
        RemoteRewardError, match=re.escape(f"{fake_vlm.url}/v1/chat/completions") + ".*HTTP 500"
    ):
        judge(random_videos(1), ["a flaky server"])
