"""The one implementation of true classifier-free guidance."""

from __future__ import annotations

import torch


def combine_cfg(
    cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float, *, renormalize: bool
) -> torch.Tensor:
    """uncond + w (cond - uncond), in float32.

    renormalize: rescale each token's combined prediction to the norm of the conditional one
    (over the last dim), as Qwen-Image's pipeline does; SD3 does not.
    """
    cond = cond.float()
    uncond = uncond.float()
    combined = uncond + guidance_scale * (cond - uncond)
    if renormalize:
        cond_norm = torch.linalg.vector_norm(cond, dim=-1, keepdim=True)
        combined_norm = torch.linalg.vector_norm(combined, dim=-1, keepdim=True)
        combined = combined * (cond_norm / combined_norm)
    return combined
