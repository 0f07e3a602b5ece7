"""The HTTP API (serve_app.serving.http_api) over real HTTP on loopback, in front of apps in Serve's local
testing mode (tests/http_server.py): complete trajectories in the binary format, bitwise what a handle caller
gets; weight versions published, listed and served; the bearer token; and every bad upload refused by name
with nothing stored."""

import json
import socket
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from serve_app.client import RolloutClient
from serve_app.errors import PolicyVersionError
from serve_app.http_client import HttpRolloutClient
from serve_app.stored import NotSentError
from serve_app.weights import LoraSpec, content_hash
from serve_app.wire import TRAJECTORY_MEDIA_TYPE, WEIGHTS_MEDIA_TYPE, encode_weights, pack
from tests.http_server import assert_same_batch, serve_http

TOKEN = "http-api-test-token"
BASE = ["sampling.num_steps=4", "sampling.sde_window_range=[0,2]", "ingress.chunk_size=4"]
LORA = LoraSpec(rank=2, alpha=4.0, target_modules=["proj_out"])


@pytest.fixture(scope="module")
def app(start_local_app, tmp_path_factory):
    """The tiny Qwen-Image app (true CFG: a negative prompt row) with its own weight folder."""
    weights = tmp_path_factory.mktemp("weights")
    handle = start_local_app("diffusion_rollout", [*BASE, f"replica.weights_dir={weights}"], name="http-api")
    return handle, weights


@pytest.fixture(scope="module")
def url(app):
    with serve_http(app[0], token=TOKEN, max_upload_bytes=200_000) as address:
        yield address


@pytest.fixture(scope="module")
def client(url):
    return HttpRolloutClient(url, TOKEN)


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_the_binary_answer_is_bitwise_what_a_handle_caller_gets(app, client):
    by_handle = RolloutClient(handle=app[0]).rollout(["a cat", "two red circles"], 3, seed=11, return_images=True)
    over_http = client.rollout(["a cat", "two red circles"], 3, seed=11, return_images=True)
    assert_same_batch(over_http, by_handle)
    assert torch.equal(over_http.images, by_handle.images)
    assert over_http.transitions.negative_embeds is not None  # true CFG: the negative row crossed too


def test_what_was_not_asked_for_is_not_sent(client, url):
    batch = client.rollout(["a cat"], 2, seed=3, fetch=False)
    assert batch.header.log_probs.shape == (2, 2) and batch.advantages.shape == (2,)
    with pytest.raises(NotSentError, match="return_trajectory"):
        _ = batch.transitions
    with pytest.raises(NotSentError, match="return_images"):
        _ = batch.images
    # The trajectory needs the binary answer: asked for as JSON it is a 406 naming the field.
    refused = httpx.post(f"{url}/v1/rollouts", headers=auth(), timeout=60,
                         json={"prompts": ["a cat"], "group_size": 2, "return_trajectory": True})
    assert refused.status_code == 406 and refused.json()["field"] == "return_trajectory"
    # The JSON answer is as it was.
    answer = httpx.post(f"{url}/v1/rollouts", headers=auth(), timeout=60,
                        json={"prompts": ["a cat"], "group_size": 2, "seed": 3}).json()
    assert [s["seed"] for s in answer["samples"]] == batch.header.seeds.tolist()
    assert [s["log_probs"] for s in answer["samples"]] == batch.header.log_probs.tolist()


def test_bytes_on_the_wire_are_the_tensors_and_a_small_header(url):
    body = {"prompts": ["a cat", "a dog"], "group_size": 4, "seed": 1, "return_trajectory": True}
    answer = httpx.post(f"{url}/v1/rollouts", json=body, headers={**auth(), "Accept": TRAJECTORY_MEDIA_TYPE},
                        timeout=60)
    assert answer.headers["content-type"] == TRAJECTORY_MEDIA_TYPE
    length = int.from_bytes(answer.content[:8], "little")
    header = json.loads(answer.content[8:8 + length])
    tensor_bytes = sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__")
    assert len(answer.content) == 8 + length + tensor_bytes  # nothing but the header and the tensors
    assert {"latents", "prompt_embeds.embeds", "negative_embeds.embeds", "sigmas", "step_indices"} <= header.keys()


ALGORITHM_SAMPLING = {
    "dance_grpo": {"sde_type": "dance", "noise_level": 0.3},
    "mix_grpo": {"sde_window_range": [1, 2], "ode_solver": "dpm2m"},
    "diffusion_nft": {"noise_level": 0.0, "ode_solver": "dpm2m", "record": "final"},
}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHM_SAMPLING))
def test_each_algorithms_sampling_crosses_bitwise_by_handle_and_over_http(app, client, algorithm):
    sampling = ALGORITHM_SAMPLING[algorithm]
    by_handle = RolloutClient(handle=app[0]).rollout(["a cat", "a dog"], 2, seed=5, sampling=sampling)
    over_http = client.rollout(["a cat", "a dog"], 2, seed=5, sampling=sampling)
    assert_same_batch(over_http, by_handle)
    transitions = over_http.transitions
    assert transitions.sampling.model_dump(include=set(sampling)) == {
        k: tuple(v) if isinstance(v, list) else v for k, v in sampling.items()}
    if algorithm == "diffusion_nft":  # the final latents and the conditioning; no transitions
        assert transitions.latents.shape[:2] == (4, 2) and transitions.log_probs.shape == (4, 0)
        assert transitions.step_indices.tolist() == []
    else:
        expected_steps = [1, 2] if algorithm == "mix_grpo" else transitions.step_indices.tolist()
        assert transitions.step_indices.tolist() == expected_steps and len(expected_steps) == 2
        assert transitions.latents.shape[:2] == (4, 3) and torch.isfinite(transitions.log_probs).all()


def test_final_latents_alone_are_a_fraction_of_the_windows_bytes(url):
    def answer_bytes(sampling: dict) -> int:
        body = {"prompts": ["a cat", "a dog"], "group_size": 4, "seed": 1, "return_trajectory": True,
                "sampling": {"noise_level": 0.0, "sde_window_size": None, "sde_window_range": [0, 1], **sampling}}
        answer = httpx.post(f"{url}/v1/rollouts", json=body, headers={**auth(), "Accept": TRAJECTORY_MEDIA_TYPE},
                            timeout=60)
        assert answer.status_code == 200, answer.text
        return len(answer.content)

    window, final = answer_bytes({}), answer_bytes({"record": "final"})
    # Four steps: the window keeps five latents per sample and three log-probs, final two latents (0.55 of the bytes).
    assert final < window * 0.6, (final, window)


def lora_tensors(seed: int, scale: float = 0.1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"proj_out.lora_A.weight": torch.randn(2, 32, generator=g) * scale,
            "proj_out.lora_B.weight": torch.randn(16, 2, generator=g) * scale}


def stored_versions(app) -> list[str]:
    """Every entry of the weight folder (versions, and any staging folder a failed publish left)."""
    return sorted(p.name for p in app[1].iterdir() if not p.name.endswith(".lock"))


def test_a_published_version_is_listed_described_and_served(app, client):
    before = client.versions().latest
    version, weights_hash = client.publish(lora_tensors(1), kind="lora", lora=LORA)
    assert version == before + 1 and weights_hash == content_hash(lora_tensors(1), LORA)
    listed = client.versions()
    assert listed.latest == version and listed.versions[0].kind == "base" and listed.versions[-1].policy_version == version
    info = client.version(version)
    assert (info.kind, info.tensors, info.bytes, info.weights_hash) == ("lora", 2, (64 + 32) * 4, weights_hash)
    assert info.lora == {"rank": 2, "alpha": 4.0, "target_modules": ["proj_out"]}
    # The replicas serve it: a rollout pinned to it is stamped with its hash, and differs from the base's.
    pinned = client.rollout(["a cat"], 2, seed=5, policy_version=version)
    base = client.rollout(["a cat"], 2, seed=5, policy_version=0)
    assert (pinned.policy_version, pinned.header.weights_hash) == (version, weights_hash)
    assert not torch.equal(pinned.transitions.latents[:, -1], base.transitions.latents[:, -1])
    with pytest.raises(PolicyVersionError):
        client.rollout(["a cat"], 2, seed=5, policy_version=version + 100)
    missing = httpx.get(f"{client.url}/v1/weights/{version + 100}", headers=auth(), timeout=30)
    assert missing.status_code == 404 and "does not exist" in missing.json()["message"]


def test_publishers_at_once_get_distinct_ordered_versions(app, client):
    seeds = list(range(100, 106))
    with ThreadPoolExecutor(len(seeds)) as pool:
        published = list(pool.map(lambda s: (s, *client.publish(lora_tensors(s), kind="lora", lora=LORA)), seeds))
    versions = [v for _, v, _ in published]
    assert len(set(versions)) == len(seeds) and sorted(versions) == list(range(min(versions), min(versions) + len(seeds)))
    for seed, version, weights_hash in published:  # each number holds the content its publisher sent
        assert client.version(version).weights_hash == weights_hash == content_hash(lora_tensors(seed), LORA)


def _upload(tensors, *, kind="lora", lora=LORA, expected_hash=None) -> bytes:
    return bytes(encode_weights(tensors, kind=kind, lora=lora, expected_hash=expected_hash))


A, B = "proj_out.lora_A.weight", "proj_out.lora_B.weight"


@pytest.mark.parametrize(("body", "status", "field", "message"), [
    pytest.param(b"not safetensors at all", 422, "body", "header length", id="not-safetensors"),
    pytest.param(_upload(lora_tensors(0))[:-10], 422, "body", "truncated", id="truncated"),
    pytest.param(bytes(pack(lora_tensors(0), {"format": "something else"})), 422, "body", "flowgrpo.weights/1",
                 id="other-format"),
    pytest.param(_upload({**lora_tensors(0), "proj_in.lora_A.weight": torch.zeros(2, 16)}), 422, "tensors",
                 "no place for", id="unknown-name"),
    pytest.param(_upload({A: lora_tensors(0)[A]}), 422, "tensors", "missing", id="missing-name"),
    pytest.param(_upload({A: torch.zeros(2, 31), B: lora_tensors(0)[B]}), 422, "tensors", "shape", id="wrong-shape"),
    pytest.param(_upload({A: lora_tensors(0)[A].to(torch.int64), B: lora_tensors(0)[B]}), 422, "tensors", "int64",
                 id="integer-dtype"),
    pytest.param(_upload({A: lora_tensors(0)[A].double(), B: lora_tensors(0)[B]}), 422, "tensors", "float64",
                 id="float64"),
    pytest.param(_upload({A: lora_tensors(0)[A], B: torch.full((16, 2), float("nan"))}), 422, "tensors", "NaN",
                 id="nan"),
    pytest.param(_upload({A: lora_tensors(0)[A], B: torch.full((16, 2), float("inf"))}), 422, "tensors", "infinite",
                 id="inf"),
    pytest.param(_upload(lora_tensors(0), lora=LoraSpec(2, 4.0, ["nothing_like_this"])), 422,
                 "lora.target_modules", "match no layer", id="targets-match-nothing"),
    pytest.param(_upload(lora_tensors(0), lora=LoraSpec(2, 4.0, ["transformer_blocks.0"])), 422,
                 "lora.target_modules", "adapt Linear layers", id="target-not-linear"),
    pytest.param(_upload(lora_tensors(0), expected_hash="0" * 64), 409, "", "hash to", id="hash-mismatch"),
    pytest.param(_upload({"x": torch.zeros(60_000)}, kind="full"), 413, "body", "max_upload_bytes", id="too-large"),
])
def test_a_bad_upload_is_refused_naming_what_is_wrong_and_nothing_is_stored(app, url, body, status, field, message):
    before = stored_versions(app)
    answer = httpx.post(f"{url}/v1/weights", content=body, timeout=60,
                        headers={**auth(), "Content-Type": WEIGHTS_MEDIA_TYPE})
    assert answer.status_code == status, answer.text
    assert answer.json()["field"] == field and message in answer.json()["message"], answer.json()
    assert stored_versions(app) == before


def test_an_upload_over_the_limit_is_refused_while_it_streams(app, url):
    before = stored_versions(app)
    chunks = (b"\0" * 50_000 for _ in range(10))  # chunked: no Content-Length to refuse it by
    answer = httpx.post(f"{url}/v1/weights", content=chunks, headers=auth(), timeout=60)
    assert answer.status_code == 413 and "max_upload_bytes" in answer.json()["message"]
    assert stored_versions(app) == before


def test_a_publisher_killed_mid_upload_leaves_no_version(app, url, client):
    before = stored_versions(app)
    body = _upload(lora_tensors(7))
    parts = urllib.parse.urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/weights HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {TOKEN}\r\n"
                     f"Content-Type: {WEIGHTS_MEDIA_TYPE}\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        sock.sendall(body[: len(body) // 2])
    # The service answers the next publisher as before, and holds nothing of the first.
    version, _ = client.publish(lora_tensors(8), kind="lora", lora=LORA)
    assert stored_versions(app) == sorted([*before, f"v{version:08d}"])


def test_the_token_guards_every_endpoint_but_healthz(app, url):
    before = stored_versions(app)
    for token in (None, "wrong-token"):
        refused = httpx.post(f"{url}/v1/weights", content=_upload(lora_tensors(5)), timeout=30,
                             headers={} if token is None else auth(token))
        assert refused.status_code == 401 and refused.json()["error"] == "UnauthorizedError"
        headers = {} if token is None else auth(token)
        for method, path in (("post", "/v1/rollouts"), ("post", "/v1/weights"), ("get", "/v1/weights"),
                             ("get", "/v1/weights/0"), ("post", "/rollout/generate"), ("get", "/docs"),
                             ("get", "/openapi.json")):
            answer = httpx.request(method, f"{url}{path}", headers=headers, timeout=30, json={})
            assert answer.status_code == 401, (method, path, token)
            assert answer.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{url}/healthz", timeout=30).json() == {"status": "ok"}
    assert httpx.get(f"{url}/openapi.json", headers=auth(), timeout=30).status_code == 200
    assert stored_versions(app) == before  # nothing the refused uploads held was stored


def test_without_a_token_publishing_is_off_and_nothing_is_stored(app):
    before = stored_versions(app)
    with serve_http(app[0], token=None) as open_url:
        refused = httpx.post(f"{open_url}/v1/weights", content=_upload(lora_tensors(9)), timeout=30)
        assert refused.status_code == 403 and "api_token_file" in refused.json()["message"]
        assert httpx.get(f"{open_url}/v1/weights", timeout=30).status_code == 200  # reading stays open
    assert stored_versions(app) == before


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tiny_sd3", "tiny_qwen_image_edit"])
def test_families_with_pooled_or_input_image_conditioning_cross_bitwise(start_local_app, family):
    handle = start_local_app("diffusion_rollout", [*BASE, f"model={family}"], name=f"http-api-{family}")
    images = None
    if family == "tiny_qwen_image_edit":
        generator = torch.Generator().manual_seed(0)
        images = [torch.randint(0, 256, (3, 24, 40), dtype=torch.uint8, generator=generator) for _ in range(2)]
    with serve_http(handle, token=None) as address:
        over_http = HttpRolloutClient(address).rollout(["a cat", "a dog"], 2, seed=4, images=images)
    # Over HTTP the images travel as PNGs, which decode to the same pixels the handle caller sends.
    by_handle = RolloutClient(handle=handle).rollout(["a cat", "a dog"], 2, seed=4, images=images)
    assert_same_batch(over_http, by_handle)
    embeds = over_http.transitions.prompt_embeds
    assert (embeds.pooled is not None) if family == "tiny_sd3" else (embeds.image_latents is not None)


# A trainer's process with only the HTTP client: Ray unimportable, and nothing of the serving code loaded.
RAY_FREE = """
import json, sys
sys.modules["ray"] = None
import torch
from serve_app.http_client import HttpRolloutClient
client = HttpRolloutClient(sys.argv[1], sys.argv[2])
batch = client.rollout(["a cat"], 2, seed=11, sampling={"num_steps": 4})
g = torch.Generator().manual_seed(21)
tensors = {"proj_out.lora_A.weight": torch.randn(2, 32, generator=g), "proj_out.lora_B.weight": torch.randn(16, 2, generator=g)}
version, digest = client.publish(tensors, kind="lora", lora={"rank": 2, "alpha": 4, "target_modules": ["proj_out"]})
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "deployments", "diffusers", "transformers", "fastapi")
               or m.startswith("serve_app.serving"))
print(json.dumps({"latents": list(batch.transitions.latents.shape), "seeds": batch.header.seeds.tolist(),
                  "version": version, "hash": digest, "heavy": [m for m in heavy if sys.modules[m] is not None]}))
"""


def test_a_process_with_only_the_http_client_rolls_out_and_publishes(client, url):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", RAY_FREE, url, TOKEN], cwd=repo, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(repo)}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["heavy"] == []
    assert report["latents"] == [2, 3, 16, 16]
    assert report["seeds"] == client.rollout(["a cat"], 2, seed=11, sampling={"num_steps": 4}).header.seeds.tolist()
    # alpha 4 (an int) names the same spec as 4.0: the hash is of the spec as the replicas read it.
    g = torch.Generator().manual_seed(21)
    sent = {A: torch.randn(2, 32, generator=g), B: torch.randn(16, 2, generator=g)}
    assert report["hash"] == content_hash(sent, LORA) == client.version(report["version"]).weights_hash


def _sglang(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/rollout/generate", json=body, headers=auth(), timeout=120)


def _tensor(encoded: dict) -> torch.Tensor:
    """SGLang's reader: base64 of a safetensors file holding the tensor "t" (read with the reference library)."""
    import base64

    from safetensors.torch import load

    assert encoded["__tensor__"] is True
    tensor = load(base64.b64decode(encoded["data"]))["t"]
    assert list(tensor.shape) == encoded["shape"] and str(tensor.dtype) == encoded["dtype"]
    return tensor


def test_sglang_rollout_generate_answers_in_sglangs_layout(app, url):
    import msgpack

    body = {"prompt": "a cat", "negative_prompt": " ", "seed": 13, "num_outputs_per_prompt": 3,
            "num_inference_steps": 4, "true_cfg_scale": 4.0, "rollout_sde_type": "sde", "rollout_noise_level": 0.7,
            "rollout_sde_step_indices": [1, 2], "rollout_return_dit_trajectory": True,
            "rollout_return_denoising_env": True, "generator_device": "cuda"}
    answer = _sglang(url, body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/msgpack"
    samples = msgpack.unpackb(answer.content, raw=False)
    assert len(samples) == 3 and {s["request_id"] for s in samples} == {samples[0]["request_id"]}
    assert set(samples[0]) == {"request_id", "prompt", "seed", "generated_output", "rollout_log_probs",
                               "rollout_debug_tensors", "denoising_env", "dit_trajectory", "inference_time_s",
                               "peak_memory_mb"}
    # The same group by handle: the window placed exactly at step 1, two steps long.
    ours = RolloutClient(handle=app[0]).rollout(["a cat"], 3, seed=13, return_images=True, sampling={
        "num_steps": 4, "guidance_scale": 4.0, "noise_level": 0.7, "sde_window_size": 2, "sde_window_range": [1, 2],
        "negative_prompt": " "}).trajectory
    assert ours.step_indices.tolist() == [1, 2]
    for i, sample in enumerate(samples):
        assert (sample["prompt"], sample["seed"]) == ("a cat", 13)
        log_probs = _tensor(sample["rollout_log_probs"])
        assert log_probs.shape == (4,) and log_probs[[0, 3]].eq(0).all()  # 0 on deterministic steps, as SGLang's
        assert torch.equal(log_probs[1:3], ours.log_probs[i])
        trajectory = sample["dit_trajectory"]
        assert torch.equal(_tensor(trajectory["latents"]), ours.latents[i])
        assert _tensor(trajectory["latent_step_indices"]).tolist() == [1, 2, 3]
        assert torch.equal(_tensor(trajectory["sigmas"]), ours.sigmas)
        assert torch.equal(_tensor(trajectory["timesteps"]), ours.sigmas[[1, 2, 3]] * 1000)
        assert torch.equal(_tensor(sample["generated_output"]), ours.images[i].float() / 255)
        positive = sample["denoising_env"]["pos_cond_kwargs"]
        length = positive["txt_seq_lens"][0]
        assert torch.equal(_tensor(positive["encoder_hidden_states"][0]), ours.prompt_embeds.embeds[0, :length])
        assert sample["denoising_env"]["neg_cond_kwargs"] is not None  # true CFG: the negative prompt's conditioning


def test_sglang_evaluation_mode_returns_the_output_alone(url):
    import msgpack

    answer = _sglang(url, {"prompt": "a dog", "seed": 2, "rollout": False, "num_inference_steps": 4})
    [sample] = msgpack.unpackb(answer.content, raw=False)
    assert sample["rollout_log_probs"] is None and sample["dit_trajectory"] is None
    assert _tensor(sample["generated_output"]).shape == (3, 32, 32)


@pytest.mark.parametrize(("extra", "field"), [
    ({"fps": 16}, "fps"),
    ({"image_path": ["/etc/passwd"]}, "image_path"),
    ({"extra_sampling_params": {"eta": 1.0}}, "extra_sampling_params"),
    ({"rollout_log_prob_no_const": True}, "rollout_log_prob_no_const"),
    ({"rollout_debug_mode": True}, "rollout_debug_mode"),
    ({"rollout_sde_step_indices": [0, 2]}, "rollout_sde_step_indices"),
    ({"rollout_sde_step_indices": [2, 3]}, "sampling"),  # the last step is deterministic here
    ({"rollout_sde_step_indices": [1], "rollout_return_step_indices": [0, 1]}, "rollout_return_step_indices"),
    ({"rollout_sde_type": "ddim"}, "rollout_sde_type"),
    ({"guidance_scale": 3.5, "true_cfg_scale": 4.0}, "guidance_scale"),
    ({"num_inference_steps": "4"}, "num_inference_steps"),
    ({"rollout_noise_levle": 0.7}, "rollout_noise_levle"),
])
def test_sglang_fields_this_service_cannot_honour_are_a_422_naming_them(url, extra, field):
    answer = _sglang(url, {"prompt": "a cat", "seed": 1, "num_inference_steps": 4, **extra})
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == field, answer.json()


def test_schemathesis_finds_no_5xx_on_the_new_endpoints(url):
    """Bodies and parameters drawn from the OpenAPI (random bytes for uploads, random SGLang requests): every
    answer is the request's fault (4xx) or an answer (2xx), never the service's (5xx)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    spec = httpx.get(f"{url}/openapi.json", headers=auth(), timeout=30).json()
    schema = schemathesis.openapi.from_dict(spec).include(path_regex="^/(v1/weights|rollout/generate)")
    seen = {}
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def call(case):
            answer = case.call(base_url=url, headers=auth())
            seen[operation.label] = seen.get(operation.label, 0) + 1
            assert answer.status_code < 500, (case.body, answer.text[:500])

        call()
    assert set(seen) == {"POST /v1/weights", "GET /v1/weights", "GET /v1/weights/{version}", "POST /rollout/generate"}


def test_the_token_comes_from_the_file_or_the_variable_the_config_names(tmp_path, monkeypatch):
    from serve_app.config import IngressConfig
    from serve_app.serving.http_api import api_token

    assert api_token(IngressConfig()) is None
    (tmp_path / "token").write_text("  s3cret\n")
    assert api_token(IngressConfig(api_token_file=str(tmp_path / "token"))) == "s3cret"
    monkeypatch.setenv("MY_API_TOKEN", "from-env")
    assert api_token(IngressConfig(api_token_env="MY_API_TOKEN")) == "from-env"
    # A deploy that names a token must not come up open.
    with pytest.raises(ValueError, match="does not exist"):
        api_token(IngressConfig(api_token_file=str(tmp_path / "missing")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="holds no token"):
        api_token(IngressConfig(api_token_file=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="holds no token"):
        api_token(IngressConfig(api_token_env="NOT_SET_ANYWHERE"))
    with pytest.raises(ValueError, match="not both"):
        IngressConfig(api_token_file=str(tmp_path / "token"), api_token_env="MY_API_TOKEN")
