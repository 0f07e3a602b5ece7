"""What an image-conditioned stock pipeline resizes an input image to, read off its own ``__call__``, and the input
sizes the families' sweeps try (tests/policies/test_flux_kontext.py, test_qwen_image_edit.py,
test_qwen_image_edit_plus.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PIL import Image

from serve_app.config import IngressConfig
from serve_app.errors import InvalidRequestError
from serve_app.policies.base import ImageGeometry

# Sides at and just beside multiples of 16 and 32 (the released VAE factor x 2, and Qwen-Image-Edit's rounding),
# odd ones, and the extremes the ingress accepts.
MAX_SIDE = IngressConfig().max_input_image_side
SIDES = (1, 15, 16, 17, 30, 31, 32, 33, 47, 50, 63, 64, 65, 66, 230, 333, 400, 511, 512, 513, 777, 1000, 1023, 1024,
         1025, 1500, MAX_SIDE - 1, MAX_SIDE)


def sweep_sizes(*near: tuple[int, int]) -> list[tuple[int, int]]:
    """(height, width) of every pair of SIDES, and the sizes in `near` the ingress accepts."""
    near = tuple((h, w) for h, w in near if 1 <= min(h, w) and max(h, w) <= MAX_SIDE)
    return sorted({(h, w) for h in SIDES for w in SIDES} | set(near))


def near_ratios(ratios: list[float], heights: tuple[int, ...] = (97, 1001)) -> list[tuple[int, int]]:
    """Sizes whose aspect ratio (width / height) lies within a pixel of each of `ratios`, at odd heights."""
    return [(h, round(h * r) + d) for r in ratios for h in heights for d in (-1, 0, 1)]


def released_pipeline(pipeline: Any) -> Any:
    """`pipeline`'s class over its components without the VAE, so diffusers takes a VAE factor of 8 (its image
    processor at 16 px), the released FLUX.1-Kontext-dev's and Qwen-Image-Edit's, where a tiny checkpoint's is 4;
    and without text encoders, which the stock calls here never reach (Kontext's gets prompt embeddings), so each
    call walks fewer modules for its execution device."""
    unused = {name: None for name in ("vae", "text_encoder", "text_encoder_2") if name in pipeline.components}
    released = type(pipeline)(**{**pipeline.components, **unused})
    released.set_progress_bar_config(disable=True)
    return released


class _Stop(Exception):
    pass


@dataclass(frozen=True)
class StockResize:
    """What the stock ``__call__`` made of one input image before it needed the VAE."""

    resized: tuple[int, int] | None  # (height, width) it gave image_processor.resize, if it called it
    preprocessed: tuple[int, int] | None  # ... the size image_processor.preprocess resizes to (the VAE's input)
    error: Exception | None  # what it raised instead


def stock_resize(pipeline: Any, height: int, width: int, **call: Any) -> StockResize:
    """Run ``pipeline(image=<a height x width image>, **call)`` until its first image_processor.preprocess:
    the size it asked of image_processor.resize before (the encoder's copy, for Qwen-Image-Edit-Plus) and the size
    preprocess resizes to (get_default_height_width of the sizes it was given, as preprocess does itself)."""
    processor = pipeline.image_processor
    asked: dict[str, tuple[int, int]] = {}

    def resize(image: Any, h: int, w: int, **_: Any) -> Any:
        asked["resized"] = (h, w)
        return image  # the pixels do not matter here, and a 4096 px image is slow to resize

    def preprocess(image: Any, h: int | None = None, w: int | None = None, **_: Any) -> Any:
        asked["preprocessed"] = processor.get_default_height_width(image, h, w)
        raise _Stop

    processor.resize, processor.preprocess = resize, preprocess
    error = None
    try:
        pipeline(image=Image.new("RGB", (width, height)), height=32, width=32, num_inference_steps=1,
                 output_type="pt", **call)
    except _Stop:
        pass
    except Exception as exc:  # noqa: BLE001 - the stock pipeline's own failure is the result here
        error = exc
    finally:
        del processor.resize, processor.preprocess
    return StockResize(asked.get("resized"), asked.get("preprocessed"), error)


def ours_or_refused(size: Any, *args: Any) -> tuple[int, int] | None:
    """`size(*args)` (an ImageGeometry size method), or None where it refuses the image."""
    try:
        return size(*args)
    except InvalidRequestError:
        return None


def unusable(size: tuple[int, int] | None, geometry: ImageGeometry) -> bool:
    """Whether a stock size is one no model could take: a side of 0, or beyond the position embedding."""
    return size is None or min(size) == 0 or max(size) > geometry.max_side
