"""CLIP-based rewards: CLIP score and PickScore, over a transformers ``CLIPModel`` in a local directory.

Both score each image against its own prompt with the cosine similarity of CLIP's projected image
and text embeddings; they differ only in the scale:

* ``clip_score``: ``100 * cos`` (the torchmetrics / ``CLIPScore`` convention, without its clamp at
  0, so a reward can still tell apart images that all disagree with the prompt). In [-100, 100].
* ``pickscore``: ``logit_scale.exp() * cos``, PickScore's rule (Kirstain et al. 2023). PickScore's
  checkpoint is a ``CLIPModel`` (ViT-H/14) whose ``logit_scale.exp()`` is 100, so its scores are
  the usual ~18-24; point ``path`` at it and ``processor_path`` at the processor it was trained
  with (laion CLIP-ViT-H-14-laion2B-s32B-b79K's) when they live in different directories.

Models load with ``from_pretrained(dir, local_files_only=True)``: nothing is ever downloaded. Each
(process, directory, device, dtype) loads its model once; every reward built on it shares it.
transformers is imported on first use, so registering these rewards costs nothing.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Sequence

import torch

from .registry import RewardFn, check_image_batch, register_reward

if TYPE_CHECKING:
    from transformers import CLIPModel, CLIPProcessor

__all__ = ["clip_score", "load_clip", "pickscore"]

DTypeName = Literal["float32", "float16", "bfloat16"]
_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

_CACHE: dict[tuple[str, str, str, str], tuple["CLIPModel", "CLIPProcessor"]] = {}
_CACHE_LOCK = threading.Lock()


def _checkpoint_dir(path: str, what: str) -> Path:
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_dir():
        raise FileNotFoundError(
            f"{what} directory {str(path)!r} does not exist; CLIP rewards load local directories only "
            "(a saved CLIPModel/CLIPProcessor), nothing is downloaded"
        )
    return resolved


def load_clip(
    path: str, *, processor_path: str | None = None, device: str = "cpu", dtype: DTypeName = "float32"
) -> tuple["CLIPModel", "CLIPProcessor"]:
    """The ``CLIPModel`` (eval mode, on ``device`` in ``dtype``) and ``CLIPProcessor`` saved in local
    directories, loaded once per process and shared.

    Raises:
        FileNotFoundError: a directory does not exist or holds no ``config.json``.
        ValueError: unknown ``dtype``, or the directory does not hold a loadable CLIP model/processor.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    model_dir = _checkpoint_dir(path, "CLIP model")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"CLIP model directory {str(path)!r} has no config.json (expected a CLIPModel.save_pretrained output)")
    proc_dir = _checkpoint_dir(processor_path, "CLIP processor") if processor_path is not None else model_dir
    torch_device = torch.device(device)
    key = (str(model_dir), str(proc_dir), str(torch_device), dtype)
    with _CACHE_LOCK:
        # Loading under the lock: concurrent first calls of one reward server would otherwise each
        # load (and hold) their own copy of a model that can be gigabytes.
        if key not in _CACHE:
            _CACHE[key] = _load(model_dir, proc_dir, torch_device, _DTYPES[dtype])
        return _CACHE[key]


def _load(model_dir: Path, proc_dir: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import CLIPModel, CLIPProcessor

    try:
        model = CLIPModel.from_pretrained(str(model_dir), local_files_only=True, dtype=dtype)
    except Exception as e:
        raise ValueError(f"cannot load a CLIPModel from {str(model_dir)!r}: {type(e).__name__}: {e}") from e
    try:
        processor = CLIPProcessor.from_pretrained(str(proc_dir), local_files_only=True)
    except Exception as e:
        raise ValueError(f"cannot load a CLIPProcessor from {str(proc_dir)!r}: {type(e).__name__}: {e}") from e
    return model.to(device).eval().requires_grad_(False), processor


@torch.no_grad()
def clip_cosine(
    model: "CLIPModel", processor: "CLIPProcessor", images: torch.Tensor, prompts: Sequence[str], *, batch_size: int
) -> torch.Tensor:
    """Cosine similarity of each image's and its own prompt's CLIP embeddings.

    Args:
        images: uint8 ``[B, 3, H, W]`` (any size: the processor resizes and center-crops).
        prompts: ``B`` strings; texts longer than the model's context are truncated.
        batch_size: images per forward pass.

    Returns:
        float32 ``[B]`` on CPU, in [-1, 1].
    """
    device, dtype = model.device, model.dtype
    # A group repeats its prompt: encode each distinct prompt once.
    unique = list(dict.fromkeys(prompts))
    text_inputs = processor.tokenizer(
        unique,
        padding=True,
        truncation=True,
        max_length=model.config.text_config.max_position_embeddings,
        return_tensors="pt",
    ).to(device)
    text = model.get_text_features(**text_inputs).pooler_output
    text = text[torch.tensor([unique.index(p) for p in prompts], device=device)]

    cpu_images = images.detach().cpu()
    image_chunks = []
    for start in range(0, images.shape[0], batch_size):
        chunk = list(cpu_images[start : start + batch_size])
        pixels = processor.image_processor(images=chunk, return_tensors="pt")["pixel_values"]
        image_chunks.append(model.get_image_features(pixel_values=pixels.to(device=device, dtype=dtype)).pooler_output)
    image = torch.cat(image_chunks)

    # Normalise in fp32: in bf16 the cosine itself carries ~1e-2 of rounding error.
    image = torch.nn.functional.normalize(image.float(), dim=-1)
    text = torch.nn.functional.normalize(text.float(), dim=-1)
    return (image * text).sum(dim=-1).cpu()


def _clip_reward(
    scale: Literal["100", "logit_scale"],
    path: str,
    processor_path: str | None,
    device: str,
    dtype: DTypeName,
    batch_size: int,
) -> RewardFn:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    model, processor = load_clip(path, processor_path=processor_path, device=device, dtype=dtype)
    factor = 100.0 if scale == "100" else float(model.logit_scale.detach().float().exp())

    def reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_image_batch(images, prompts)
        return factor * clip_cosine(model, processor, images, prompts, batch_size=batch_size)

    return reward


@register_reward("clip_score")
def clip_score(
    path: str,
    processor_path: str | None = None,
    device: str = "cpu",
    dtype: DTypeName = "float32",
    batch_size: int = 32,
) -> RewardFn:
    """reward = 100 * cos(CLIP image embedding, CLIP embedding of the image's prompt), in [-100, 100].

    ``path``: a local ``CLIPModel`` directory (with its processor, unless ``processor_path`` names
    another directory). ``device``/``dtype``: where and in which precision the model runs.
    """
    return _clip_reward("100", path, processor_path, device, dtype, batch_size)


@register_reward("pickscore")
def pickscore(
    path: str,
    processor_path: str | None = None,
    device: str = "cpu",
    dtype: DTypeName = "float32",
    batch_size: int = 32,
) -> RewardFn:
    """PickScore's rule: reward = logit_scale.exp() * cos(image embedding, prompt embedding).

    Use PickScore_v1's ``CLIPModel`` directory as ``path`` for the real PickScore; any CLIPModel
    directory works (then it is that model's own scaled logit). Arguments as for ``clip_score``.
    """
    return _clip_reward("logit_scale", path, processor_path, device, dtype, batch_size)
