"""Generated images and videos as bytes: uint8 conversion, PNG and base64 for images, MP4 (H.264) for
videos, and the MP4 decoder the tests and clients use to read them back; and a request's input images:
base64 decoding with size limits, resizing.

An image is a uint8 tensor ``[3, H, W]``; a video a uint8 tensor or array ``[F, 3, H, W]`` (RGB, frames first), as video replicas produce it.
Encoding goes through PyAV (``pip install 'flowgrpo-serve[video]'``), whose wheels bundle FFmpeg with
libx264: the file plays in browsers and players without a codec pack. PyAV is imported only when a
video is encoded or decoded, so the rest of the service never needs it.

H.264 in ``yuv420p`` (the pixel format players support everywhere) stores colour at half resolution,
so both sides must be even: an odd height or width is padded by repeating the last row or column,
and the decoded video has the even size (``decode_mp4`` returns what the file holds; crop with the
size you asked for). Chroma subsampling also blurs colour edges: a round trip is close, not exact.
"""

from __future__ import annotations

import base64
import io
from fractions import Fraction
from typing import Any

import numpy as np
import torch

DEFAULT_FPS = 16  # Wan2.1 generates 16 frames per second
# x264's constant-rate factor: 0 is lossless (but needs the High 4:4:4 profile, which many players lack),
# 23 its default; 18 is about visually lossless, which matters for 32 px frames of hard-edged shapes.
DEFAULT_CRF = 18


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] (or [B, F, 3, H, W]) float in [0, 1] -> uint8 on the CPU, rounding to nearest."""
    return (images.float().clamp(0, 1) * 255.0).round().to(torch.uint8).cpu()


def png_base64(images: torch.Tensor) -> list[str]:
    """Base64 (standard alphabet, no line breaks) of each uint8 ``[B, 3, H, W]`` image as a PNG."""
    from PIL import Image

    encoded = []
    for arr in images.detach().cpu().permute(0, 2, 3, 1).numpy():
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(arr)).save(buffer, format="PNG")
        encoded.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return encoded


class ImageTooLargeError(ValueError):
    """An input image over the size limits (bytes or pixels)."""


def decode_image_base64(data: str, *, max_side: int, max_bytes: int) -> torch.Tensor:
    """A base64 PNG (or any image PIL reads) as uint8 [3, H, W] RGB (an alpha channel is dropped).

    The size is checked from the header before the pixels are decoded, so a small file that would
    decode to a huge image is refused cheaply.

    Raises:
        ImageTooLargeError: more than `max_bytes` decoded bytes, or a side above `max_side`.
        ValueError: not base64, or not an image.
    """
    from PIL import Image, UnidentifiedImageError

    if len(data) > 4 * -(-max_bytes // 3):
        raise ImageTooLargeError(f"is more than {max_bytes} bytes once decoded ({len(data)} base64 characters)")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raise ValueError("is not base64 (standard alphabet, no line breaks)") from None
    try:
        image = Image.open(io.BytesIO(raw))
    except Image.DecompressionBombError as exc:  # PIL's own header check, above about 180 megapixels
        raise ImageTooLargeError(f"is too large to decode ({exc})") from None
    except (UnidentifiedImageError, OSError, SyntaxError):  # PIL raises SyntaxError for a broken PNG header
        raise ValueError("is not an image PIL can read (send a PNG)") from None
    width, height = image.size
    if max(width, height) > max_side:
        raise ImageTooLargeError(f"is {height}x{width} px; each side must be at most {max_side} px")
    try:
        rgb = np.asarray(image.convert("RGB"))
    except (OSError, ValueError) as exc:  # a truncated or corrupt file fails only when decoded
        raise ValueError(f"could not be decoded: {exc}") from None
    return torch.from_numpy(rgb.transpose(2, 0, 1).copy())


def resize_image(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [3, H, W] -> uint8 [3, height, width], Lanczos (diffusers' VaeImageProcessor.resize of a PIL
    image, its default); the same image back, copied, when it already has that size."""
    from PIL import Image

    pil = to_pil(image)
    resized = pil.resize((width, height), resample=Image.Resampling.LANCZOS)
    return torch.from_numpy(np.asarray(resized).transpose(2, 0, 1).copy())


def to_pil(image: torch.Tensor) -> Any:
    """uint8 [3, H, W] -> an RGB PIL image."""
    from PIL import Image

    if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"an image must be uint8 [3, H, W]; got {image.dtype} {tuple(image.shape)}")
    return Image.fromarray(np.ascontiguousarray(image.detach().cpu().permute(1, 2, 0).numpy()))


def mp4_base64(video: torch.Tensor) -> str:
    """Base64 of one uint8 ``[F, 3, H, W]`` video as an H.264 MP4 (:func:`encode_mp4`)."""
    return base64.b64encode(encode_mp4(video)).decode("ascii")


def _av() -> Any:
    try:
        import av
    except ImportError as exc:  # an optional extra: name the fix, not only the missing module
        raise ImportError("video encoding needs PyAV: pip install 'flowgrpo-serve[video]' (or pip install av)") from exc
    return av


def _frames_hwc(video: torch.Tensor | np.ndarray) -> np.ndarray:
    """``video`` uint8 [F, 3, H, W] as a contiguous uint8 numpy [F, H', W', 3], H' and W' padded to even."""
    arr = video.detach().cpu().numpy() if isinstance(video, torch.Tensor) else np.asarray(video)
    if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[1] != 3 or arr.shape[0] < 1 or 0 in arr.shape[2:]:
        raise ValueError(f"video must be uint8 [F, 3, H, W] with F, H, W >= 1, got {arr.dtype} {tuple(arr.shape)}")
    _, _, h, w = arr.shape
    arr = np.pad(arr, ((0, 0), (0, 0), (0, h % 2), (0, w % 2)), mode="edge")
    return np.ascontiguousarray(arr.transpose(0, 2, 3, 1))


def encode_mp4(video: torch.Tensor | np.ndarray, *, fps: int = DEFAULT_FPS, crf: int = DEFAULT_CRF) -> bytes:
    """The bytes of an H.264 ``yuv420p`` MP4 of ``video`` (uint8 [F, 3, H, W], RGB) at ``fps`` frames a second.

    Raises:
        ValueError: not a uint8 [F, 3, H, W] video, or ``fps``/``crf`` out of range.
        ImportError: PyAV is not installed.
    """
    if not 1 <= fps <= 240:
        raise ValueError(f"fps must be in [1, 240], got {fps}")
    if not 1 <= crf <= 51:
        raise ValueError(f"crf must be in [1, 51] (0, lossless, needs a profile many players lack), got {crf}")
    frames = _frames_hwc(video)
    av = _av()
    buf = io.BytesIO()
    # No "+faststart" (index first, for streaming): FFmpeg's second pass reopens the output by name,
    # which an in-memory file has not, and a base64 payload arrives whole anyway.
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf), "preset": "medium"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():  # flush the frames the encoder holds back for B-frames
            container.mux(packet)
    return buf.getvalue()


def decode_mp4(data: bytes) -> torch.Tensor:
    """Every frame of an MP4's first video stream as uint8 [F, 3, H, W] RGB.

    Raises:
        ValueError: the bytes are no video FFmpeg can read.
        ImportError: PyAV is not installed.
    """
    av = _av()
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise ValueError("the file has no video stream")
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    except av.FFmpegError as exc:
        raise ValueError(f"not a readable video: {exc}") from exc
    if not frames:
        raise ValueError("the video stream has no frames")
    return torch.from_numpy(np.stack(frames).transpose(0, 3, 1, 2).copy())
