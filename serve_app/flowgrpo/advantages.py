"""Group-relative advantages of Flow-GRPO.

For a prompt ``c`` the policy draws a group of ``G`` images ``{x_0^i}``; each gets the advantage

    A^i = (R(x_0^i, c) - mean({R(x_0^j, c)}_j)) / (std(...) + eps)

(Flow-GRPO, eq. 4; the same value is used at every denoising step ``t``). The standard deviation is
the *population* one (``unbiased=False``, as ``np.std`` in the reference implementation), taken per
group or, with ``std_mode="global"``, over the whole batch. Advantages are clipped to ``+-clip``
(``adv_clip_max = 5`` in the reference config).
"""

from __future__ import annotations

from typing import Literal

import torch

StdMode = Literal["group", "global"]
STD_MODES: tuple[str, ...] = ("group", "global")


def _check_inputs(rewards: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate and return ``(rewards as float64, inverse group ids 0..K-1)``."""
    if rewards.ndim != 1 or group_index.ndim != 1 or rewards.shape != group_index.shape:
        raise ValueError(
            f"rewards and group_index must both be 1-D of the same length, got "
            f"{tuple(rewards.shape)} and {tuple(group_index.shape)}"
        )
    if rewards.numel() == 0:
        raise ValueError("rewards is empty")
    if group_index.dtype.is_floating_point or group_index.dtype.is_complex or group_index.dtype == torch.bool:
        raise ValueError(f"group_index must be an integer tensor, got {group_index.dtype}")
    # float64 so that a tied group gives exactly zero, not a rounding residue divided by eps.
    r = rewards.detach().to(device="cpu", dtype=torch.float64)
    bad = (~torch.isfinite(r)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"non-finite reward {rewards[i].item()} at index {i} ({bad.numel()} non-finite in total)")
    _, inverse = torch.unique(group_index.detach().cpu(), return_inverse=True)
    return r, inverse


def _group_sums(values: torch.Tensor, inverse: torch.Tensor, n_groups: int) -> torch.Tensor:
    return torch.zeros(n_groups, dtype=values.dtype).index_add_(0, inverse, values)


def group_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    std_mode: StdMode = "group",
    eps: float = 1e-4,
    clip: float | None = 5.0,
) -> torch.Tensor:
    """Flow-GRPO advantages ``A = (r - mean_group(r)) / (std + eps)``, clipped to ``+-clip``.

    Args:
        rewards: [B] float rewards.
        group_index: [B] integer id of the prompt group of each sample. Ids need not be contiguous,
            sorted or start at 0; samples of a group need not be adjacent.
        std_mode: ``"group"`` divides by each group's std, ``"global"`` by the std of the whole
            batch. Both use the population std (``unbiased=False``).
        eps: added to the std so that a tied group (std 0) gives zeros instead of NaNs.
        clip: clamp the advantages to ``[-clip, clip]``; ``None`` leaves them unclipped.

    Returns:
        [B] float32 advantages, on the device of ``rewards``.

    Raises:
        ValueError: shape mismatch, empty input, non-finite reward (naming its index), a
            non-integer ``group_index`` or an unknown ``std_mode``.
    """
    if std_mode not in STD_MODES:
        raise ValueError(f"unknown std_mode {std_mode!r}; expected one of {STD_MODES}")
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be positive or None, got {clip}")
    r, inverse = _check_inputs(rewards, group_index)
    n_groups = int(inverse.max()) + 1
    counts = _group_sums(torch.ones_like(r), inverse, n_groups)
    mean = _group_sums(r, inverse, n_groups) / counts
    centered = r - mean[inverse]
    if std_mode == "group":
        var = _group_sums(centered.square(), inverse, n_groups) / counts
        std = var.sqrt()[inverse]
    else:
        std = r.std(unbiased=False).expand_as(r)
    adv = centered / (std + eps)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.to(device=rewards.device, dtype=torch.float32)


def tied_group_fraction(rewards: torch.Tensor, group_index: torch.Tensor, *, atol: float = 0.0) -> float:
    """Share of groups whose rewards all tie (``max - min <= atol``).

    Such groups have all-zero advantages and so contribute no policy gradient; a high fraction means
    the reward is too coarse for the group size.
    """
    r, inverse = _check_inputs(rewards, group_index)
    n_groups = int(inverse.max()) + 1
    g_max = torch.full((n_groups,), -torch.inf, dtype=r.dtype).scatter_reduce_(0, inverse, r, reduce="amax")
    g_min = torch.full((n_groups,), torch.inf, dtype=r.dtype).scatter_reduce_(0, inverse, r, reduce="amin")
    return float(((g_max - g_min) <= atol).sum()) / n_groups
