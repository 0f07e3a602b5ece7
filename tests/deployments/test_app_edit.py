"""Image-conditioned rollouts through the whole graph (Serve's local testing mode, model=tiny_qwen_image_edit):
input images by handle and over HTTP, every sample of a group conditioned on its prompt's image (also when the
group spans chunks), the trainer's replay of the batch at ratio 1, and bad images refused naming the field."""

import base64
import io
import zlib

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from serve_app.config import IngressConfig
from serve_app.errors import InvalidRequestError, RequestTooLargeError
from serve_app.media import png_base64
from serve_app.policies.base import ImageGeometry
from serve_app.schemas import RolloutRequest, SamplingParams
from serve_app.serving.ingress import RolloutPlanner
from tests.http_server import serve_http

# Chunks of 2 samples: a group of 3 spans two chunks (two replicas' calls in a cluster).
OVERRIDES = ["model=tiny_qwen_image_edit", "sampling.num_steps=3", "sampling.sde_window_range=[0,1]",
             "ingress.chunk_size=2", "ingress.max_input_image_side=64", "ingress.max_input_image_bytes=20000"]


def _image(seed: int, height: int = 24, width: int = 40) -> torch.Tensor:
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def handle(start_local_app):
    return start_local_app("diffusion_rollout", OVERRIDES, name="flowgrpo-edit-local")


@pytest.fixture(scope="module")
def url(handle):
    """The app's HTTP API on loopback (tests/http_server.py)."""
    with serve_http(handle) as address:
        yield address


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/rollouts", json=body, timeout=120)


@pytest.fixture(scope="module")
def batch(handle):
    # By handle: a list per prompt, or a prompt's one image on its own.
    request = RolloutRequest(prompts=["make it red", "add a circle"], group_size=3, seed=1,
                             images=[[_image(0)], _image(1)])
    return handle.rollout.remote(request).result().fetch(images=True)


def test_every_sample_of_a_group_is_conditioned_on_its_prompts_image(batch, handle):
    t = batch.trajectory
    assert t.prompt_index.tolist() == [0, 0, 0, 1, 1, 1] and t.images.shape == (6, 3, 32, 32)
    # The conditioning once per prompt: the VL embeddings and the 32 x 32 input's 4 x 4 latent tokens.
    assert len(t.prompt_embeds) == 2 and t.prompt_embeds.image_latents.shape == (2, 16, 16)
    assert t.prompt_embeds.image_shapes.tolist() == [[[1, 4, 4]], [[1, 4, 4]]]
    # True CFG: the negative prompt encoded with each prompt's image, one row per prompt.
    assert len(t.negative_embeds) == 2 and t.negative_embeds.has_images
    assert not torch.equal(t.negative_embeds.image_latents[0], t.negative_embeds.image_latents[1])
    # The same seeds with another input image for the first prompt: its group changes, the other does not.
    other = handle.rollout.remote(RolloutRequest(prompts=["make it red", "add a circle"], group_size=3, seed=1,
                                                 images=[[_image(7)], [_image(1)]])).result().transitions
    assert torch.equal(other.seeds, t.seeds)
    assert float((other.latents[:3, -1] - t.latents[:3, -1]).abs().max()) > 1e-3
    torch.testing.assert_close(other.latents[3:], t.latents[3:], atol=1e-5, rtol=0)


def test_the_trainer_replays_the_batch_at_ratio_one(batch):
    from serve_app.config import load_config
    from serve_app.policies import load_configured_policy
    from serve_app.serving.engine_contract import replay_verdict

    policy = load_configured_policy(load_config("diffusion_rollout", ["model=tiny_qwen_image_edit"]).model)
    verdict = replay_verdict(policy, batch.transitions)  # groups cut across chunks and put back together
    assert verdict.ok, verdict.message


def test_http_takes_base64_pngs_and_names_a_bad_image(handle, url):
    body = {"prompts": ["make it red"], "group_size": 2, "seed": 3, "images": [png_base64(_image(0)[None])]}
    answer = _post(url, body).json()
    same = handle.rollout.remote(RolloutRequest(prompts=["make it red"], group_size=2, seed=3,
                                                images=[[_image(0)]])).result()
    assert [s["log_probs"] for s in answer["samples"]] == same.header.log_probs.tolist()  # PNG is lossless

    def refused(images, **extra) -> tuple[int, dict]:
        response = _post(url, {"prompts": ["a", "b"], "group_size": 1, "images": images, **extra})
        return response.status_code, response.json()

    good = png_base64(_image(0)[None])[0]
    status, error = refused([[good], ["bm90IGFuIGltYWdl"]])  # base64 of "not an image"
    assert (status, error["field"]) == (422, "images[1][0]") and "PNG" in error["message"]
    status, error = refused([[good], ["%%%"]])
    assert (status, error["field"]) == (422, "images[1][0]") and "base64" in error["message"]
    status, error = refused([[good], png_base64(_image(0, 24, 80)[None])])  # 80 px > max_input_image_side 64
    assert (status, error["field"]) == (413, "images[1][0]") and "64" in error["message"]
    status, error = refused([[good], [good, good]])
    assert (status, error["field"]) == (422, "images[1]") and "1 input image" in error["message"]
    status, error = refused([[good]])
    assert (status, error["field"]) == (422, "images") and "one list of input images per prompt" in error["message"]
    status, error = refused(None)
    assert (status, error["field"]) == (422, "images")
    # A bomb: 4 kB of PNG that would decode to 60 000 x 60 000 px is refused from its header.
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((1, 1, 3), dtype=np.uint8)).save(buffer, format="PNG")
    header = bytearray(buffer.getvalue())
    header[16:24] = (60000).to_bytes(4, "big") * 2  # IHDR's width and height, then its checksum
    header[29:33] = zlib.crc32(bytes(header[12:29])).to_bytes(4, "big")
    status, error = refused([[good], [base64.b64encode(bytes(header)).decode()]])
    assert (status, error["field"]) == (413, "images[1][0]")


def test_the_openapi_documents_the_images():
    from serve_app.serving.http_api import build_http_api

    schema = build_http_api(None, token=None, max_upload_bytes=1).openapi()["components"]["schemas"]["RolloutRequest"]["properties"]["images"]
    item = schema["anyOf"][0]["items"]["items"]
    assert item["contentMediaType"] == "image/png" and item["contentEncoding"] == "base64"
    assert "one list per prompt" in schema["description"]


def test_text_families_take_no_images_and_input_images_count_in_the_work_budget():
    sampling = SamplingParams(num_steps=3, guidance_scale=1.0, sde_window_range=(0, 1))
    text = RolloutPlanner(None, IngressConfig(), sampling, ImageGeometry("qwen_image", 8, 256), max_work=2**22)
    with pytest.raises(InvalidRequestError, match="takes no input images") as info:
        text.prompt_images(RolloutRequest(prompts=["a"], group_size=1, images=[[_image(0)]]), sampling)
    assert info.value.field == "images[0]"
    assert text.prompt_images(RolloutRequest(prompts=["a"], group_size=1), sampling)[0] == [[]]
    # 2 samples x 3 steps x (16 output tokens + 16 input image tokens) = 192: over a budget of 150, where the
    # output tokens alone (96) would fit.
    edit = ImageGeometry("qwen_image_edit", 8, 256, input_images=(1, 1), input_image_area=32 * 32)
    planner = RolloutPlanner(None, IngressConfig(), sampling, edit, max_work=150)
    request = RolloutRequest(prompts=["a"], group_size=2, images=[[_image(0)]])
    images, _ = planner.prompt_images(request, sampling)
    assert images[0][0].shape == (3, 32, 32)  # 24 x 40 -> the 32 x 32 px input area, rounded to 32
    with pytest.raises(RequestTooLargeError, match=r"\+ 16 input image tokens x 2 samples a prompt") as info:
        planner.check_work(request, sampling, images)
    assert info.value.field == "sampling"
    # An aspect ratio whose short side rounds to nothing is refused naming the image.
    with pytest.raises(InvalidRequestError, match="aspect ratio") as info:
        planner.prompt_images(RolloutRequest(prompts=["a"], group_size=1, images=[[_image(0, 8, 64)]]), sampling)
    assert info.value.field == "images[0][0]"


def test_flux_kontext_conditions_each_group_on_its_image_and_replays_at_ratio_one(start_local_app):
    from serve_app.config import load_config
    from serve_app.policies import load_configured_policy
    from serve_app.serving.engine_contract import replay_verdict

    overrides = ["model=tiny_flux_kontext", "sampling.num_steps=3", "sampling.sde_window_range=[0,1]",
                 "ingress.chunk_size=2"]
    handle = start_local_app("diffusion_rollout", overrides, name="flowgrpo-kontext-local")
    prompts = ["make it red", "add a circle"]
    batch = handle.rollout.remote(RolloutRequest(prompts=prompts, group_size=3, seed=1,
                                                 images=[[_image(0)], [_image(1)]])).result().fetch(images=True)
    t = batch.trajectory
    assert t.prompt_index.tolist() == [0, 0, 0, 1, 1, 1] and t.images.shape == (6, 3, 32, 32)
    # 24 x 40 px keeps its size (Kontext's nearest resolution at the 32 x 32 px area): 3 x 5 packed latent tokens.
    assert t.prompt_embeds.image_latents.shape == (2, 15, 16)
    assert t.prompt_embeds.image_shapes.tolist() == [[[1, 3, 5]], [[1, 3, 5]]]
    other = handle.rollout.remote(RolloutRequest(prompts=prompts, group_size=3, seed=1,
                                                 images=[[_image(7)], [_image(1)]])).result().transitions
    assert float((other.latents[:3, -1] - t.latents[:3, -1]).abs().max()) > 1e-3
    torch.testing.assert_close(other.latents[3:], t.latents[3:], atol=1e-5, rtol=0)
    policy = load_configured_policy(load_config("diffusion_rollout", ["model=tiny_flux_kontext"]).model)
    verdict = replay_verdict(policy, batch.transitions)
    assert verdict.ok, verdict.message


def test_qwen_image_edit_plus_conditions_each_group_on_its_images_and_replays_at_ratio_one(start_local_app):
    """Several input images a prompt (Qwen-Image-Edit-Plus): prompts with one and with two images in one
    request, over HTTP as base64 PNGs too; every image of a prompt conditions its group."""
    from serve_app.config import load_config
    from serve_app.policies import load_configured_policy
    from serve_app.serving.engine_contract import replay_verdict

    overrides = ["model=tiny_qwen_image_edit_plus", "sampling.num_steps=3", "sampling.sde_window_range=[0,1]",
                 "ingress.chunk_size=2"]
    handle = start_local_app("diffusion_rollout", overrides, name="flowgrpo-edit-plus-local")
    prompts = ["put the first on the second", "make it red"]
    wide = _image(2, 20, 48)  # 32 x 64 px at the input area: 4 x 8 latent tokens
    request = {"prompts": prompts, "group_size": 3, "seed": 1}
    batch = handle.rollout.remote(RolloutRequest(**request, images=[[_image(0), wide], [_image(1)]])
                                  ).result().fetch(images=True)
    t = batch.trajectory
    assert t.prompt_index.tolist() == [0, 0, 0, 1, 1, 1] and t.images.shape == (6, 3, 32, 32)
    assert t.prompt_embeds.image_shapes.tolist() == [[[1, 4, 4], [1, 4, 8]], [[1, 4, 4], [0, 0, 0]]]
    assert t.prompt_embeds.image_latents.shape == (2, 16 + 32, 16)
    # Another second image for the first prompt: its group changes, the other prompt's does not.
    other = handle.rollout.remote(RolloutRequest(**request, images=[[_image(0), _image(9, 20, 48)], [_image(1)]])
                                  ).result().transitions
    assert float((other.latents[:3, -1] - t.latents[:3, -1]).abs().max()) > 1e-3
    torch.testing.assert_close(other.latents[3:], t.latents[3:], atol=1e-5, rtol=0)
    # Over HTTP: a list of base64 PNGs per prompt gives the same samples.
    first, second, other = (png_base64(image[None])[0] for image in (_image(0), wide, _image(1)))
    body = {**request, "images": [[first, second], [other]]}
    with serve_http(handle) as address:
        answer = _post(address, body).json()
    assert [s["log_probs"] for s in answer["samples"]] == batch.header.log_probs.tolist()
    # Four images are one too many, named by field.
    with pytest.raises(InvalidRequestError, match="1 to 3 input image") as info:
        handle.rollout.remote(RolloutRequest(**request, images=[[_image(0)] * 4, [_image(1)]])).result()
    assert info.value.field == "images[0]"
    policy = load_configured_policy(load_config("diffusion_rollout", ["model=tiny_qwen_image_edit_plus"]).model)
    verdict = replay_verdict(policy, batch.transitions)
    assert verdict.ok, verdict.message
