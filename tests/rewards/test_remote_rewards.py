"""remote_score and vlm_judge against stub HTTP servers on 127.0.0.1, each started and stopped by its test."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from serve_app.rewards import CompositeReward, RewardError, build_reward
from serve_app.rewards.remote import RemoteRewardError, parse_score, spaced_frames
from serve_app.local_ray import free_loopback_port

FAST = {"backoff_s": 0.01, "max_backoff_s": 0.05}  # retries without waiting seconds


def fast(attempts: int) -> dict:
    return {"attempts": attempts, **FAST}


class Stub:
    """Records requests and answers each with ``respond(index, body, headers) -> (status, reply[, headers])``.

    ``reply`` is JSON-encoded unless it is bytes. Counts requests in flight to check concurrency limits.
    """

    def __init__(self, respond, delay_s: float = 0.0) -> None:
        self.respond = respond
        self.delay_s = delay_s
        self.requests: list[tuple[str, dict, dict]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()


@contextlib.contextmanager
def serve(respond, delay_s: float = 0.0):
    stub = Stub(respond, delay_s)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            with stub.lock:
                index = len(stub.requests)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append((self.path, body, dict(self.headers)))
                stub.in_flight += 1
                stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
            try:
                time.sleep(stub.delay_s)
                status, reply, *extra = stub.respond(index, body, dict(self.headers))
            finally:
                # Leave the count before the reply goes out: once the client has read it, it may
                # start its next request, and that one must not overlap this one in the count.
                with stub.lock:
                    stub.in_flight -= 1
            payload = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
            self.send_response(status)
            for key, value in (extra[0] if extra else {}).items():
                self.send_header(key, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request, client_address):
            pass  # a client that timed out and left makes the late reply fail; expected here

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    stub.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield stub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def noise(b, size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, 3, size, size), dtype=torch.uint8, generator=g)


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64, validate=True))))


def brightness_plus_length(index, body, headers):
    """A scoring API: mean pixel / 255 + len(prompt) / 100 per image."""
    scores = [float(decode(img).mean()) / 255 + len(p) / 100 for img, p in zip(body["images"], body["prompts"])]
    return 200, {"scores": scores, "model": "stub"}


def expected_brightness_plus_length(images, prompts):
    return torch.tensor([images[i].double().mean().item() / 255 + len(p) / 100 for i, p in enumerate(prompts)], dtype=torch.float64)


# --- remote_score ------------------------------------------------------------------------------


def test_remote_score_returns_the_servers_scores_in_order():
    images, prompts = noise(5), ["a", "bb", "ccc", "dddd", "eeeee"]
    with serve(brightness_plus_length) as stub:
        scores = build_reward("remote_score", url=stub.url + "/score", batch_size=3)(images, prompts)
    assert scores.dtype == torch.float32 and scores.shape == (5,)
    torch.testing.assert_close(scores.double(), expected_brightness_plus_length(images, prompts), rtol=0, atol=1e-6)
    assert sorted(len(body["images"]) for _, body, _ in stub.requests) == [2, 3]
    assert {path for path, _, _ in stub.requests} == {"/score"}
    # PNG is lossless: the server saw exactly our pixels.
    first = next(body for _, body, _ in stub.requests if body["prompts"][0] == "a")
    assert np.array_equal(decode(first["images"][0]), images[0].permute(1, 2, 0).numpy())


@pytest.mark.parametrize("status", [503, 429])
def test_transient_status_is_retried(status):
    def flaky(index, body, headers):
        if index == 0:
            return status, {"error": "busy"}, {"Retry-After": "0.3"}
        return brightness_plus_length(index, body, headers)

    images = noise(2)
    with serve(flaky) as stub:
        start = time.monotonic()
        reward = build_reward("remote_score", url=stub.url, retry={"attempts": 3, "backoff_s": 0.01, "max_backoff_s": 1.0})
        scores = reward(images, ["x", "y"])
        elapsed = time.monotonic() - start
    assert len(stub.requests) == 2
    torch.testing.assert_close(scores.double(), expected_brightness_plus_length(images, ["x", "y"]), rtol=0, atol=1e-6)
    assert 0.3 <= elapsed < 1.0  # Retry-After stretched the 0.01 s backoff (within max_backoff_s)


def test_always_failing_server_fails_after_exactly_its_attempts():
    with serve(lambda i, b, h: (500, {"error": "boom"})) as stub:
        reward = build_reward("remote_score", url=stub.url + "/score", retry=fast(3))
        with pytest.raises(RemoteRewardError) as info:
            reward(noise(2), ["p", "p"])
        assert len(stub.requests) == 3
        assert info.value.attempts == 3
        message = str(info.value)
        assert stub.url + "/score" in message and "HTTP 500" in message and "3 attempts" in message
        assert '"boom"' in message  # the server's own words, for the operator

        composite = CompositeReward([{"name": "remote_score", "args": {"url": stub.url, "retry": fast(2)}}])
        with pytest.raises(RewardError) as wrapped:
            composite.score(noise(2), ["a red cube", "a red cube"])
    assert wrapped.value.reward_name == "remote_score" and wrapped.value.prompt == "a red cube"
    assert "RemoteRewardError" in wrapped.value.detail and "2 attempts" in wrapped.value.detail


@pytest.mark.parametrize(
    ("status", "headers", "match"),
    [(400, {}, "HTTP 400.*bad image.*not retried"), (307, {"Location": "/elsewhere"}, "HTTP 307.*redirects are not followed")],
)
def test_client_errors_and_redirects_are_not_retried(status, headers, match):
    with serve(lambda i, b, h: (status, {"error": "bad image"}, headers)) as stub:
        with pytest.raises(RemoteRewardError, match="after 1 attempt: " + match):
            build_reward("remote_score", url=stub.url + "/score", retry=fast(4))(noise(1), ["p"])
    assert [path for path, _, _ in stub.requests] == ["/score"]


def test_timeout_is_retried_then_reported():
    with serve(brightness_plus_length, delay_s=1.0) as stub:
        reward = build_reward("remote_score", url=stub.url, timeout_s=0.2, retry=fast(2))
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match=r"after 2 attempts: timed out after 0.2 s"):
            reward(noise(1), ["p"])
        elapsed = time.monotonic() - start
        assert len(stub.requests) == 2
    assert 0.4 <= elapsed < 1.5  # a client that waited for the 1 s replies would take >= 2 s


def test_refused_connection_is_retried_then_reported():
    port = free_loopback_port()  # nothing listens there
    reward = build_reward("remote_score", url=f"http://127.0.0.1:{port}/score", retry=fast(2))
    with pytest.raises(RemoteRewardError, match=rf"127.0.0.1:{port}/score failed after 2 attempts: .*[Rr]efused"):
        reward(noise(1), ["p"])


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        (b"<html>oops</html>", "reply is not JSON"),
        (b'{"scores": [NaN]}', "reply is not JSON.*non-finite"),
        ({"scores": [1.0, 2.0]}, r"reply must be \{\"scores\": \[1 numbers\]\}"),
        ({"scores": [True]}, "reply must be"),
        ({"score": 1.0}, "reply must be"),
    ],
)
def test_unusable_replies_fail_without_retry(reply, match):
    with serve(lambda i, b, h: (200, reply)) as stub:
        with pytest.raises(RemoteRewardError, match="unusable reply: " + match):
            build_reward("remote_score", url=stub.url, retry=fast(3))(noise(1), ["p"])
    assert len(stub.requests) == 1


def test_api_key_comes_from_the_named_environment_variable(monkeypatch):
    monkeypatch.setenv("STUB_SCORER_KEY", "s3cret")
    with serve(brightness_plus_length) as stub:
        build_reward("remote_score", url=stub.url, api_key_env="STUB_SCORER_KEY")(noise(1), ["p"])
        build_reward("remote_score", url=stub.url + "/open")(noise(1), ["p"])
    assert stub.requests[0][2]["Authorization"] == "Bearer s3cret"
    assert "Authorization" not in stub.requests[1][2]
    monkeypatch.delenv("STUB_SCORER_KEY")
    with pytest.raises(ValueError, match="'STUB_SCORER_KEY', which is not set"):
        build_reward("remote_score", url="http://127.0.0.1:9/x", api_key_env="STUB_SCORER_KEY")
    with pytest.raises(ValueError, match="bad args for reward 'remote_score'"):
        build_reward("remote_score", url="http://127.0.0.1:9/x", api_key="s3cret")


def test_bad_transport_settings_fail_at_build():
    for kwargs, match in [
        ({"url": "file:///etc/passwd"}, "http:// or https://"),
        ({"url": "http://127.0.0.1:9/a", "retry": {"attempts": 0}}, "attempts"),
        ({"url": "http://127.0.0.1:9/a", "timeout_s": 0}, "timeout_s must be a positive number"),
        ({"url": "http://127.0.0.1:9/a", "retry": {"backoff_s": 2.0, "max_backoff_s": 1.0}}, r"backoff_s \(2.0\) must be <= max_backoff_s"),
    ]:
        with pytest.raises(ValueError, match=match):
            build_reward("remote_score", **kwargs)
    build_reward("remote_score", url="http://127.0.0.1:9/limit", max_concurrency=2)
    with pytest.raises(ValueError, match="already limits that endpoint to 2"):
        build_reward("remote_score", url="http://127.0.0.1:9/limit", max_concurrency=3)


def test_error_survives_pickling():
    error = pickle.loads(pickle.dumps(RemoteRewardError("http://h/score", "HTTP 500", 3)))
    assert (error.endpoint, error.cause, error.attempts) == ("http://h/score", "HTTP 500", 3)
    assert str(error) == "POST http://h/score failed after 3 attempts: HTTP 500"


# --- concurrency ---------------------------------------------------------------------------------


def test_concurrency_limit_is_shared_per_endpoint():
    def judge_seven(index, body, headers):
        return 200, {"choices": [{"message": {"role": "assistant", "content": "Score: 7"}}]}

    with serve(judge_seven, delay_s=0.15) as stub:
        args = {"base_url": stub.url + "/v1", "model": "stub-vlm", "max_concurrency": 2}
        alone = build_reward("vlm_judge", **args)
        scores = alone(noise(6), ["p"] * 6)
        assert scores.tolist() == [7.0] * 6
        assert stub.max_in_flight == 2  # parallel, but never more than the limit

        # Two rewards on one endpoint, called from two threads at once, share the limit.
        other = build_reward("vlm_judge", **args)
        results = {}
        threads = [threading.Thread(target=lambda k=k, r=r: results.update({k: r(noise(4), ["p"] * 4)}))
                   for k, r in enumerate([alone, other])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
    assert len(stub.requests) == 14
    assert stub.max_in_flight == 2
    assert all(results[k].tolist() == [7.0] * 4 for k in (0, 1))


# --- vlm_judge -----------------------------------------------------------------------------------


def test_vlm_judge_sends_a_chat_completion_and_parses_the_score():
    replies = {"a red cube": "Score: 7", "two cats": "After careful thought... score = 3.5/10"}

    def judge(index, body, headers):
        text = body["messages"][0]["content"][0]["text"]
        prompt = next(p for p in replies if f'"{p}"' in text)
        return 200, {"id": "x", "choices": [{"index": 0, "message": {"role": "assistant", "content": replies[prompt]}}]}

    images = noise(2)
    with serve(judge) as stub:
        reward = build_reward("vlm_judge", base_url=stub.url + "/v1/", model="qwen-vl", max_tokens=8)
        scores = reward(images, ["a red cube", "two cats"])
    assert scores.tolist() == [7.0, 3.5]
    bodies = sorted((body for _, body, _ in stub.requests), key=lambda b: b["messages"][0]["content"][0]["text"])
    assert {path for path, _, _ in stub.requests} == {"/v1/chat/completions"}
    body = bodies[0]
    assert body["model"] == "qwen-vl" and body["max_tokens"] == 8 and body["temperature"] == 0.0
    text, image = body["messages"][0]["content"]
    assert text["text"].startswith('Does this image show "a red cube"?')
    prefix = "data:image/png;base64,"
    assert image["type"] == "image_url" and image["image_url"]["url"].startswith(prefix)
    assert np.array_equal(decode(image["image_url"]["url"][len(prefix):]), images[0].permute(1, 2, 0).numpy())


def video_noise(b, frames, size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, frames, 3, size, size), dtype=torch.uint8, generator=g)


def test_remote_score_sends_each_video_as_its_frames_in_order():
    videos, prompts = video_noise(3, frames=4), ["a", "bb", "ccc"]

    def mean_of_last_frame(index, body, headers):
        assert "images" not in body
        return 200, {"scores": [float(decode(frames[-1]).mean()) for frames in body["videos"]]}

    with serve(mean_of_last_frame) as stub:
        scores = build_reward("remote_score", url=stub.url + "/score", batch_size=2)(videos, prompts)
    expected = videos[:, -1].double().mean(dim=(1, 2, 3))
    torch.testing.assert_close(scores.double(), expected, rtol=0, atol=1e-4)
    assert sorted(len(body["videos"]) for _, body, _ in stub.requests) == [1, 2]
    first = next(body for _, body, _ in stub.requests if body["prompts"][0] == "a")
    assert [decode(f).tolist() for f in first["videos"][0]] == [f.permute(1, 2, 0).tolist() for f in videos[0]]


def test_vlm_judge_sees_a_video_as_evenly_spaced_frames_in_one_message():
    videos = video_noise(2, frames=9)

    def judge(index, body, headers):
        return 200, {"choices": [{"message": {"role": "assistant", "content": "Score: 6"}}]}

    with serve(judge) as stub:
        reward = build_reward("vlm_judge", base_url=stub.url + "/v1", model="qwen-vl", max_frames=3)
        scores = reward(videos, ["a ball moving left", "a cube"])
    assert scores.tolist() == [6.0, 6.0]
    assert len(stub.requests) == 2  # one judgement per video, not per frame
    body = next(b for _, b, _ in stub.requests if '"a ball moving left"' in b["messages"][0]["content"][0]["text"])
    text, *pictures = body["messages"][0]["content"]
    assert text["text"].startswith('These are frames of one video, in time order. Does the video show "a ball moving left"?')
    prefix = "data:image/png;base64,"
    sent = [decode(p["image_url"]["url"][len(prefix):]) for p in pictures]
    assert [s.tolist() for s in sent] == [videos[0, k].permute(1, 2, 0).tolist() for k in (0, 4, 8)]


@pytest.mark.parametrize(("num_frames", "max_frames", "indices"), [
    (4, 8, [0, 1, 2, 3]), (9, 3, [0, 4, 8]), (81, 5, [0, 20, 40, 60, 80]), (10, 4, [0, 3, 6, 9]), (5, 1, [0]),
    (7, 6, [0, 1, 2, 4, 5, 6]),
])
def test_spaced_frames_are_in_order_without_repeats_ending_on_the_last(num_frames, max_frames, indices):
    assert spaced_frames(num_frames, max_frames) == indices


def test_remote_rewards_reject_what_is_neither_images_nor_videos():
    reward = build_reward("remote_score", url="http://127.0.0.1:9/score")
    with pytest.raises(ValueError, match=r"videos must be a uint8 tensor \[B, F, 3, H, W\]"):
        reward(torch.zeros(2, 3, 1, 8, 8, dtype=torch.uint8), ["a", "b"])  # channels where frames go
    with pytest.raises(ValueError, match="max_frames"):
        build_reward("vlm_judge", base_url="http://127.0.0.1:9/v1", model="m", max_frames=0)


@pytest.mark.parametrize("content", ["no idea", "Score: 12", ""])
def test_vlm_judge_rejects_unparseable_or_out_of_range_replies(content):
    reply = {"choices": [{"message": {"role": "assistant", "content": content}}]}
    with serve(lambda i, b, h: (200, reply)) as stub:
        reward = build_reward("vlm_judge", base_url=stub.url + "/v1", model="m", retry=fast(3))
        with pytest.raises(RemoteRewardError, match="unusable reply: (no score found|score 12 outside)"):
            reward(noise(1), ["p"])
    assert len(stub.requests) == 1


def test_vlm_judge_rejects_a_reply_that_is_not_a_chat_completion():
    with serve(lambda i, b, h: (200, {"output": "Score: 7"})) as stub:
        with pytest.raises(RemoteRewardError, match=r"no choices\[0\].message.content"):
            build_reward("vlm_judge", base_url=stub.url, model="m")(noise(1), ["p"])


def test_vlm_judge_question_template_is_checked():
    with pytest.raises(ValueError, match=r"field \{prompt\} and no other"):
        build_reward("vlm_judge", base_url="http://127.0.0.1:9/v1", model="m", question="Rate {image}")
    with pytest.raises(ValueError, match=r"field \{prompt\} and no other"):
        build_reward("vlm_judge", base_url="http://127.0.0.1:9/v1", model="m", question="Rate it")


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ("Score: 7", 7.0),
        ("score=8.5", 8.5),
        ("The image matches well.\nSCORE: 9/10", 9.0),
        ("On a scale of 0 to 10 I would say... Score: 6", 6.0),  # the labelled number, not the first one
        ('{"score": 4, "reason": "ok"}', 4.0),
        ("7", 7.0),
        (" 7/10. ", 7.0),
        ("0", 0.0),
    ],
)
def test_parse_score_rules(reply, score):
    assert parse_score(reply, min_score=0, max_score=10) == score


@pytest.mark.parametrize("reply", ["no idea", "I'd give it seven", "7 or 8", "Score: -1", "Score: 10.5", '{"score": "7"}x'])
def test_parse_score_rejects(reply):
    with pytest.raises(ValueError, match="judge's reply"):
        parse_score(reply, min_score=0, max_score=10)
