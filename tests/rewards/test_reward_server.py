"""Rewards on RewardServer deployments (Serve's local testing mode), and fail-closed scoring against a
stub HTTP scorer on loopback: 0.5 s per answer, 5% answered 503 (a fixed seed says which)."""

import json
import random
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch

from serve_app.serving.aggregator import TrajectoryAssembler
from serve_app.config import AdvantageConfig
from serve_app.errors import http_error
from serve_app.rewards import build_reward, register_reward
from serve_app.rewards.composite import CompositeReward, RewardError, RewardSpec
from serve_app.schemas import PromptEmbeds, RolloutRequest, SamplingParams, Trajectory

from tests.collect import collect
from tests.http_server import serve_http


@register_reward("test_server_fails_on")
def fails_on(word: str):
    def reward(images, prompts):
        refused = [p for p in prompts if word in p]  # a RewardServer fuses calls: several prompts
        if refused:
            raise ConnectionError(f"scorer refused {refused[0]!r}")
        return images.float().mean(dim=(1, 2, 3)) / 255.0

    return reward


@register_reward("test_server_rank", groupwise=True)
def rank():
    def reward(images, prompts):
        if len(set(prompts)) != 1:
            raise ValueError("a groupwise reward got samples of several prompts")
        return torch.argsort(torch.argsort(images.float().mean(dim=(1, 2, 3)))).float()

    return reward


# --- the app with rewards on their own deployments -------------------------------------------------

REWARDS = (
    "reward.components=["
    "{name: brightness, args: {target: 0.8}, placement: deployment, server: {max_batch_size: 4}},"
    "{name: test_server_rank, weight: 0.1, placement: deployment},"
    "{name: test_server_fails_on, weight: 0.0, args: {word: unscorable}, placement: deployment, retry: {attempts: 2, backoff_s: 0.0},"
    " on_error: drop_group},"
    "{name: test_server_fails_on, weight: 0.0, args: {word: fatal}}]"
)
OVERRIDES = ["sampling.num_steps=4", "sampling.sde_window_range=[0,2]", "ingress.chunk_size=3", REWARDS]


@pytest.fixture(scope="module")
def app(start_local_app):
    return start_local_app("diffusion_rollout", OVERRIDES, name="flowgrpo-reward-servers")


def test_rewards_on_servers_score_every_chunk(app):
    batch = app.rollout.remote(RolloutRequest(prompts=["a cat", "a dog"], group_size=4, seed=2)).result()
    images = batch.images
    expected = build_reward("brightness", target=0.8)(images, ["a cat"] * 8)
    torch.testing.assert_close(batch.rewards["brightness"], expected, rtol=0, atol=1e-6)
    # The groupwise reward ranked within each whole group, although chunks of 3 split the groups.
    assert batch.rewards["test_server_rank"].view(2, 4).sort(dim=1).values.tolist() == [[0, 1, 2, 3]] * 2
    torch.testing.assert_close(batch.rewards["total"], expected + 0.1 * batch.rewards["test_server_rank"])
    assert batch.dropped_groups == {} and batch.metrics["dropped_groups"] == 0.0


def test_a_group_the_reward_fails_on_is_dropped_and_named(app):
    batch = app.rollout.remote(RolloutRequest(prompts=["a cat", "an unscorable dog"], group_size=4, seed=2)).result()
    assert list(batch.dropped_groups) == [1] and len(batch) == 4
    assert batch.trajectory.prompt_index.tolist() == [0] * 4
    why = batch.dropped_groups[1]
    assert "'test_server_fails_on' failed on prompt 'an unscorable dog'" in why and "(after 2 attempts)" in why
    assert "ConnectionError: scorer refused" in why
    from serve_app.serving.ingress import to_response

    answer = json.loads(to_response(batch, images=None).model_dump_json())  # what HTTP callers read
    assert answer["dropped_groups"] == {"1": why} and len(answer["samples"]) == 4


def test_a_failing_reward_fails_the_request_with_502_naming_it(app):
    request = RolloutRequest(prompts=["a cat", "a fatal dog"], group_size=2, seed=1)
    with pytest.raises(RewardError) as info:
        app.rollout.remote(request).result()
    assert info.value.reward_name == "test_server_fails_on" and info.value.prompt == "a fatal dog"
    status, body = http_error(info.value)
    assert status == 502 and body["error"] == "reward_failed"
    assert body["message"] == "reward 'test_server_fails_on' failed on prompt 'a fatal dog': ConnectionError: scorer refused 'a fatal dog'"
    with serve_http(app) as url:  # the HTTP route's own answer
        response = httpx.post(f"{url}/v1/rollouts", json=request.model_dump(exclude_none=True), timeout=120)
    assert response.status_code == 502 and response.json()["message"] == body["message"]


# --- a stub HTTP scorer on loopback: 0.5 s per answer, 5% 503 -----------------------------------

LATENCY_S = 0.5
FAIL_RATE = 0.05


class StubScorer(ThreadingHTTPServer):
    """Answers {"prompt", "means"} with 1 + mean / 255 per image after LATENCY_S, or 503 when its
    seeded draw for that answer (in arrival order) falls under FAIL_RATE."""

    daemon_threads = True
    request_queue_size = 128  # all 40 calls connect at once; the default backlog of 5 would refuse some

    def __init__(self, seed: int):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.answers = 0
        self.failed_prompts: list[str] = []


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server: StubScorer = self.server  # type: ignore[assignment]
        with server.lock:
            server.answers += 1
            fail = server.rng.random() < FAIL_RATE
            if fail:
                server.failed_prompts.append(body["prompt"])
        time.sleep(LATENCY_S)
        if fail:
            self.send_error(503, "scorer overloaded")
            return
        payload = json.dumps([1.0 + m / 255.0 for m in body["means"]]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):  # keep the test output clean
        pass


@register_reward("test_stub_http")
def stub_http(url: str):
    def reward(images, prompts):
        means = images.float().mean(dim=(1, 2, 3)).tolist()
        data = json.dumps({"prompt": prompts[0], "means": means}).encode()
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as answer:  # raises HTTPError on a 503
            return torch.tensor(json.loads(answer.read()))

    return reward


@pytest.fixture
def scorer():
    servers = []

    def start(seed: int) -> StubScorer:
        server = StubScorer(seed)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


GROUPS, GROUP_SIZE = 40, 2
PROMPTS = [f"prompt {g}" for g in range(GROUPS)]


def chunks() -> list[Trajectory]:
    """GROUPS groups in chunks of one group; image (p, s) is grey level 5 p + s + 1."""
    out = []
    for p in range(GROUPS):
        levels = torch.tensor([5 * p + s + 1 for s in range(GROUP_SIZE)], dtype=torch.uint8)
        out.append(Trajectory(
            latents=torch.zeros(GROUP_SIZE, 2, 4), log_probs=torch.zeros(GROUP_SIZE, 1), sigmas=torch.linspace(1, 0, 3),
            step_indices=torch.tensor([0]), images=levels.view(-1, 1, 1, 1).expand(GROUP_SIZE, 3, 4, 4).contiguous(),
            seeds=torch.arange(GROUP_SIZE), prompt_embeds=PromptEmbeds(torch.zeros(1, 2, 4), torch.ones(1, 2, dtype=torch.bool)),
            embed_row=torch.zeros(GROUP_SIZE, dtype=torch.long), negative_embeds=None, sampling=SamplingParams(),
            prompt_index=torch.full((GROUP_SIZE,), p), sample_index=torch.arange(GROUP_SIZE), policy_version=0,
            weights_hash="base",
        ))
    return out


def expected_reward(p: int) -> torch.Tensor:
    return torch.tensor([1.0 + (5 * p + s + 1) / 255.0 for s in range(GROUP_SIZE)])


def seed_failing(first_answers: int, at_least: int) -> int:
    """The first seed whose draws make at least `at_least` of the first answers a 503 (deterministic)."""
    for seed in range(1000):
        rng = random.Random(seed)
        if sum(rng.random() < FAIL_RATE for _ in range(first_answers)) >= at_least:
            return seed
    raise AssertionError("no such seed")


class Events:
    def __init__(self):
        self.outcomes = []

    def record(self, key, outcome, seconds):
        self.outcomes.append(outcome)


def stub_assembler(url: str, events: Events, **spec) -> TrajectoryAssembler:
    reward = CompositeReward([RewardSpec(name="test_stub_http", args={"url": url}, **spec)])
    return TrajectoryAssembler(reward, AdvantageConfig(), reward_threads=GROUPS, observer=events)


def test_stub_scorer_drop_group_drops_exactly_the_groups_it_failed(scorer):
    server = scorer(seed_failing(GROUPS, 2))
    events = Events()
    asm = stub_assembler(f"http://127.0.0.1:{server.server_port}/score", events, on_error="drop_group")
    batch = collect(asm, chunks(), PROMPTS, GROUP_SIZE, request_id="drop")
    failed = {PROMPTS.index(p) for p in server.failed_prompts}
    assert len(failed) >= 2 and set(batch.dropped_groups) == failed
    for g, why in batch.dropped_groups.items():
        assert why.startswith(f"reward 'test_stub_http' failed on prompt 'prompt {g}': HTTPError: HTTP Error 503")
    # No silent zero: every kept sample carries exactly the scorer's answer.
    kept = [p for p in range(GROUPS) if p not in failed]
    torch.testing.assert_close(batch.rewards["test_stub_http"], torch.cat([expected_reward(p) for p in kept]))
    assert batch.trajectory.prompt_index.unique().tolist() == kept
    assert events.outcomes.count("failed") == len(failed) and batch.metrics["dropped_groups"] == len(failed)


def test_stub_scorer_retries_recover_every_503(scorer):
    server = scorer(seed_failing(GROUPS, 2))
    events = Events()
    asm = stub_assembler(f"http://127.0.0.1:{server.server_port}/score", events, retry={"attempts": 4, "backoff_s": 0.01})
    started = time.perf_counter()
    batch = collect(asm, chunks(), PROMPTS, GROUP_SIZE, request_id="retry")
    assert len(server.failed_prompts) >= 2 and events.outcomes.count("retry") == len(server.failed_prompts)
    assert server.answers == GROUPS + len(server.failed_prompts)
    torch.testing.assert_close(batch.rewards["test_stub_http"], torch.cat([expected_reward(p) for p in range(GROUPS)]))
    # 40 calls in parallel, then the retries: two rounds of 0.5 s, not forty.
    assert time.perf_counter() - started < 6 * LATENCY_S


def test_stub_scorer_without_retries_fails_the_request_naming_the_prompt(scorer):
    server = scorer(seed_failing(GROUPS, 1))
    asm = stub_assembler(f"http://127.0.0.1:{server.server_port}/score", Events())
    with pytest.raises(RewardError) as info:
        collect(asm, chunks(), PROMPTS, GROUP_SIZE, request_id="fail")
    assert info.value.reward_name == "test_stub_http" and info.value.prompt in server.failed_prompts
    assert info.value.detail.startswith("HTTPError: HTTP Error 503")
