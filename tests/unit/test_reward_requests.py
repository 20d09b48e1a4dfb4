"""Every malformed ``POST /score`` the reward service can detect is answered 4xx naming the problem,
never 500 (a server fault) or a traceback.

A table of malformed requests, by kind — shapes with an empty axis (no video, no frame, no row, no
column: zero frames was a 500 with a Ray task traceback), frames too small for a hosted reward, wrong
dtypes, ranks and channel counts, prompts and reward lists of the wrong type or length, metadata that
is not JSON or lacks a key, another wire version, bodies that are not safetensors or are cut short, a
hostile request id — each sent through the service that both engines share (``parse_score_body`` and
``score_videos``, here the threading engine's ``RewardService`` in process) to each hosted reward,
and one of them over HTTP. ``tests/unit/test_reward_service.py`` sends the same kinds to the Ray
engine.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import requests
from safetensors.numpy import save

from miles.rewards import build_rewards
from miles.rewards.remote import WIRE_VERSION, encode_request
from miles.rewards.serve import RewardService, make_server
from miles.rewards.serve_common import RequestError

HOSTED = ["jpeg_incompressibility", "sharpness", "world_adherence"]
PROMPT = "a small red ball moving left"


def _body(frames=None, **metadata) -> bytes:
    frames = np.zeros((1, 5, 16, 16, 3), np.uint8) if frames is None else frames
    meta = {"version": str(WIRE_VERSION), "request_id": "r1", "prompts": json.dumps([PROMPT] * len(frames))}
    meta["rewards"] = json.dumps(["sharpness"])
    meta.update({k: v for k, v in metadata.items() if v is not None})
    for key in [k for k, v in metadata.items() if v is None]:
        del meta[key]
    return save({"videos": frames}, metadata=meta)


def _frames(shape, dtype=np.uint8) -> np.ndarray:
    return np.zeros(shape, dtype)


# case -> (body, text the 4xx names)
CASES = {
    "no video": (lambda n: encode_request(_frames((0, 5, 16, 16, 3)), [], [n], "r"), "at least one video"),
    "zero frames": (lambda n: encode_request(_frames((1, 0, 16, 16, 3)), [PROMPT], [n], "r"), "at least one frame"),
    "zero rows": (lambda n: encode_request(_frames((1, 5, 0, 16, 3)), [PROMPT], [n], "r"), "1x1 pixels"),
    "zero columns": (lambda n: encode_request(_frames((1, 5, 16, 0, 3)), [PROMPT], [n], "r"), "1x1 pixels"),
    "float frames": (lambda n: encode_request(_frames((1, 5, 16, 16, 3), np.float32), [PROMPT], [n], "r"), "uint8"),
    "int16 frames": (lambda n: encode_request(_frames((1, 5, 16, 16, 3), np.int16), [PROMPT], [n], "r"), "uint8"),
    "four axes": (lambda n: encode_request(_frames((5, 16, 16, 3)), [PROMPT], [n], "r"), "(B, F, H, W, 3)"),
    "one channel": (lambda n: encode_request(_frames((1, 5, 16, 16, 1)), [PROMPT], [n], "r"), "(B, F, H, W, 3)"),
    "two prompts for one video": (lambda n: encode_request(_frames((1, 5, 16, 16, 3)), [PROMPT, PROMPT], [n], "r"), "1 prompts"),
    "no reward": (lambda n: encode_request(_frames((1, 5, 16, 16, 3)), [PROMPT], [], "r"), "at least one reward"),
    "unknown reward": (lambda n: encode_request(_frames((1, 5, 16, 16, 3)), [PROMPT], ["nope"], "r"), "does not host"),
    "a reward twice": (lambda n: encode_request(_frames((1, 5, 16, 16, 3)), [PROMPT], [n, n], "r"), "does not host"),
    "prompts not JSON": (lambda n: _body(prompts="[oops"), "malformed /score body"),
    "prompts not strings": (lambda n: _body(prompts=json.dumps([1])), "JSON lists of str"),
    "rewards a string": (lambda n: _body(rewards=json.dumps(n)), "JSON lists of str"),
    "no request id": (lambda n: _body(request_id=None), "malformed /score body"),
    "another wire version": (lambda n: _body(version="99"), "wire version 99"),
    "version not a number": (lambda n: _body(version="x"), "malformed /score body"),
    "not safetensors": (lambda n: b"\x00" * 64, "malformed /score body"),
    "empty body": (lambda n: b"", "malformed /score body"),
    "cut short": (lambda n: _body()[:-7], "malformed /score body"),
    "header length huge": (lambda n: b"\xff" * 8 + b"{}", "malformed /score body"),
    "hostile request id": (lambda n: encode_request(_frames((1, 5, 16, 16, 3)), [PROMPT], [n], "../x"), "request_id"),
}  # fmt: skip


@pytest.fixture(scope="module")
def service() -> RewardService:
    return RewardService(build_rewards(dict.fromkeys(HOSTED, 1.0)).rewards)


@pytest.mark.parametrize("reward", HOSTED)
@pytest.mark.parametrize("case", list(CASES))
def test_every_malformed_request_is_a_4xx_naming_it(service, case, reward):
    make, message = CASES[case]
    with pytest.raises(RequestError) as info:
        service.score(make(reward))
    assert 400 <= info.value.status < 500
    assert message in str(info.value), str(info.value)
    assert "Traceback" not in str(info.value)


def test_frames_a_reward_cannot_read_are_its_4xx(service):
    body = encode_request(_frames((1, 5, 1, 1, 3)), [PROMPT], ["world_adherence"], "tiny")
    with pytest.raises(RequestError, match="frames of 1x1 pixels are too small") as info:
        service.score(body)
    assert info.value.status == 400
    for name in ("jpeg_incompressibility", "sharpness"):  # these read 1x1 frames
        service.score(encode_request(_frames((1, 5, 1, 1, 3)), [PROMPT], [name], f"tiny-{name}"))


def test_over_http_a_zero_frame_request_is_400_and_the_server_goes_on(service):
    server = make_server(service)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        body = encode_request(_frames((1, 0, 16, 16, 3)), [PROMPT], ["world_adherence"], "zero")
        r = requests.post(url + "/score", data=body, timeout=30)
        assert r.status_code == 400 and "at least one frame" in r.json()["error"], r.text
        good = encode_request(_frames((1, 5, 16, 16, 3)), [PROMPT], ["sharpness"], "good")
        assert requests.post(url + "/score", data=good, timeout=30).status_code == 200
    finally:
        server.shutdown()
        server.server_close()


def test_the_client_retries_through_urllib3_and_honours_retry_after():
    """The HTTP rewards' retries are urllib3's ``Retry`` on the session (through ``HTTPAdapter``): a
    dropped connection, then a 503 with ``Retry-After: 1``, then the answer — two retries, the second
    after the server's second; a 400 is not retried."""
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from urllib3.util import Retry

    from miles.rewards.remote import RETRY_STATUS, HttpClient, RemoteRewardError

    seen = []

    class Flaky(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(time.monotonic())
            if len(seen) == 1:
                self.close_connection = True  # the answer is lost
                return
            status, body = (503, b'{"error": "busy"}') if len(seen) == 2 else (200, b"{}")
            status = 400 if self.path == "/bad" else status
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            if status == 503:
                self.send_header("Retry-After", "1")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        client = HttpClient(
            requests.Session(), timeout_s=10, retries=3, backoff_s=0.01, counters=["num_retries"]
        )
        policy = client.session.get_adapter(url).max_retries
        assert isinstance(policy, Retry) and policy.total == 3 and policy.allowed_methods is None
        assert set(policy.status_forcelist) == set(RETRY_STATUS)
        assert client.request("POST", url + "/score", data=b"x").status_code == 200
        assert len(seen) == 3 and seen[2] - seen[1] >= 0.95  # Retry-After: 1
        assert client.counts() == {"num_retries": 2}
        seen[:] = [0.0, 0.0]  # the next answer is the 400
        with pytest.raises(RemoteRewardError, match=r"refused with HTTP 400 \(not retried\)"):
            client.request("POST", url + "/bad", data=b"x")
        assert len(seen) == 3
    finally:
        server.shutdown()
        server.server_close()
