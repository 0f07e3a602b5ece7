"""Video rewards, and the convention every video reward follows.

A *video reward* is called like an image reward, with videos in place of images:
``(videos uint8 [B, F, 3, H, W], prompts) -> float32 [B]``, one prompt and one value per video, frames
in time order. It validates its input with :func:`check_video_batch`, the 5-D twin of
``check_image_batch``. The rewards of this module:

- ``frames``: any registered image reward (name or import path, and its args) scored on every frame
  in one call over the ``B * F`` frames, then reduced per video by ``mean`` or ``min`` (the worst
  frame: a video is only as right as its weakest frame).
- ``temporal_consistency``: how alike consecutive frames are, optionally after the best small
  shift of the whole frame (so steady motion is not punished as flicker); in [-1, 0], 0 when every
  frame equals the previous one (shifted).
- ``first_frame`` (image-to-video): how close each video's first frame is to the input image it was
  asked to start from; in [-1, 0], 0 when the first frame is the image.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import torch

from .registry import RewardFn, build_reward, check_image_batch, declares_groupwise, register_reward, sees_input_images


def check_video_batch(videos: torch.Tensor, prompts: Sequence[str]) -> None:
    """Raise ValueError unless ``videos`` is uint8 ``[B, F, 3, H, W]`` with ``F >= 1`` and there are ``B`` prompts."""
    if (not isinstance(videos, torch.Tensor) or videos.dtype != torch.uint8 or videos.ndim != 5
            or videos.shape[2] != 3 or videos.shape[1] < 1):
        desc = f"{videos.dtype} {tuple(videos.shape)}" if isinstance(videos, torch.Tensor) else type(videos).__name__
        raise ValueError(f"videos must be a uint8 tensor [B, F, 3, H, W] with F >= 1, got {desc}")
    if isinstance(prompts, str) or len(prompts) != videos.shape[0]:
        n = "a str" if isinstance(prompts, str) else len(prompts)
        raise ValueError(f"expected {videos.shape[0]} prompts, one per video, got {n}")


_REDUCTIONS = ("mean", "min")


def check_sample_batch(samples: torch.Tensor, prompts: Sequence[str]) -> None:
    """Images uint8 [B, 3, H, W], or - from a video family - videos uint8 [B, F, 3, H, W]; raises
    ValueError otherwise. Rewards that take either (the remote ones, a RewardServer) check with this."""
    if isinstance(samples, torch.Tensor) and samples.ndim == 5:
        check_video_batch(samples, prompts)
    else:
        check_image_batch(samples, prompts)


@register_reward("frames", takes="videos")
def frames(reward: str, reduce: Literal["mean", "min"] = "mean", **reward_args: Any) -> RewardFn:
    """An image reward applied to every frame of each video and reduced over the frames.

    Args:
        reward: the image reward, a registered name or a ``"package.module:attr"`` path.
        reduce: ``mean`` over frames, or ``min`` (the worst frame).
        **reward_args: the image reward's own args. They sit beside ``reward`` and ``reduce``, not in
            a nested mapping, because a reward spec's args are flat values; an image reward with an
            arg named ``reward`` or ``reduce`` cannot be wrapped.

    Raises:
        ValueError: unknown ``reduce``, an unknown or groupwise image reward, or bad ``reward_args``.
    """
    if reduce not in _REDUCTIONS:
        raise ValueError(f"reduce must be one of {', '.join(_REDUCTIONS)}, got {reduce!r}")
    # A groupwise reward compares the samples of a group; frames of one video are no group of samples.
    if declares_groupwise(reward):
        raise ValueError(f"reward {reward!r} is groupwise; frames() wraps per-image rewards only")
    per_image = build_reward(reward, **reward_args)

    def video_reward(videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_video_batch(videos, prompts)
        b, f = videos.shape[:2]
        # One call over all B*F frames: a batched reward (a model) runs once, not once per frame.
        frame_prompts = [p for p in prompts for _ in range(f)]
        values = torch.as_tensor(per_image(videos.flatten(0, 1), frame_prompts))
        if values.shape != (b * f,):
            raise ValueError(f"image reward {reward!r} returned shape {tuple(values.shape)} for {b * f} frames")
        values = values.to(torch.float32).view(b, f)
        return values.mean(dim=1) if reduce == "mean" else values.amin(dim=1)

    return video_reward


@register_reward("temporal_consistency", takes="videos")
def temporal_consistency(max_shift: int = 0) -> RewardFn:
    """reward = -(mean over consecutive frame pairs of the mean absolute pixel difference, in [0, 1]).

    With ``max_shift = s > 0`` each frame is first compared with the previous one moved by the
    whole-frame translation of at most ``s`` px along each axis that makes them most alike (what
    moves in from beyond the border is the background: the median colour of the frame's border): an
    object moving steadily by up to ``s`` px a frame over a plain background costs nothing, while
    flicker, objects that pop up or jump and colour changes still do. ``s = 0`` compares frames as
    they are, which a static video maximises.

    Values lie in [-1, 0]; 0 means every frame repeats the previous one (moved by at most ``s``).
    Videos need at least two frames. A shift search costs ``(2s + 1)^2`` frame comparisons: cheap at
    32 px, slow on full-size frames (score a downscaled copy there).
    """
    if not isinstance(max_shift, int) or isinstance(max_shift, bool) or not 0 <= max_shift <= 8:
        raise ValueError(f"max_shift must be an int in [0, 8] (px per frame), got {max_shift!r}")

    def reward(videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_video_batch(videos, prompts)
        b, f, c, h, w = videos.shape
        if f < 2:
            raise ValueError(f"temporal_consistency needs videos of at least 2 frames, got {f}")
        x = videos.float() / 255.0
        prev, nxt = x[:, :-1].reshape(-1, c, h, w), x[:, 1:].reshape(-1, c, h, w)
        s = max_shift
        # The whole next frame is compared, never only an overlap, so a shift cannot hide what changed;
        # a border that repeated the edge would smear an object leaving it, hence the background.
        padded = _background_of(prev)[:, :, None, None].repeat(1, 1, h + 2 * s, w + 2 * s)
        padded[..., s : s + h, s : s + w] = prev
        best = None
        for dy in range(-s, s + 1):
            for dx in range(-s, s + 1):
                moved = padded[..., s - dy : s - dy + h, s - dx : s - dx + w]  # prev moved by (dy, dx)
                diff = (nxt - moved).abs().mean(dim=(1, 2, 3))
                best = diff if best is None else torch.minimum(best, diff)
        return -best.view(b, f - 1).mean(dim=1)

    return reward


def _background_of(frames: torch.Tensor) -> torch.Tensor:
    """[N, C] per-channel median of the outermost ring of pixels of each frame of ``frames`` [N, C, H, W]."""
    ring = torch.cat([frames[..., 0, :], frames[..., -1, :], frames[..., 1:-1, 0], frames[..., 1:-1, -1]], dim=-1)
    return ring.median(dim=-1).values


@register_reward("first_frame", takes="videos")
@sees_input_images
def first_frame() -> RewardFn:
    """Image-to-video: reward = -(mean absolute pixel difference, in [0, 1], of each video's first frame to the
    input image its prompt gave), the image as the model conditioned on it (at the video's size).

    The stock pipeline never pins the first frame: the transformer only sees the image along its channels,
    so a policy can drift from it, and this is the reward that says so. Values lie in [-1, 0].

    Raises:
        ValueError: at a call, unless every video has exactly one input image of its own frames' size.
    """

    def reward(videos: torch.Tensor, prompts: Sequence[str], *, input_images: Sequence[Sequence[torch.Tensor]]
               ) -> torch.Tensor:
        check_video_batch(videos, prompts)
        if len(input_images) != videos.shape[0] or any(len(row) != 1 for row in input_images):
            raise ValueError("first_frame needs exactly one input image per video (an image-to-video family)")
        starts = torch.stack([row[0] for row in input_images]).to(videos.device)
        if starts.shape != videos[:, 0].shape:
            raise ValueError(f"input images {tuple(starts.shape[1:])} do not match the first frames "
                             f"{tuple(videos.shape[2:])}")
        return -(videos[:, 0].float() - starts.float()).abs().mean(dim=(1, 2, 3)) / 255.0

    return reward
