"""Optional sampling backends. `diffusers` (the default) needs nothing here; `vllm_omni` is a GPU-only
extra that is not part of the CPU install."""

from __future__ import annotations

import importlib.util


def require_vllm_omni() -> None:
    """Fail early, and say how to fix it, when the vllm-omni backend is asked for but missing."""
    if importlib.util.find_spec("vllm_omni") is None:
        raise ImportError(
            "replica.backend=vllm_omni needs the optional vllm-omni package (GPU only): "
            "pip install 'flowgrpo-serve[vllm_omni]' on a CUDA machine, or set replica.backend=diffusers"
        )
    raise NotImplementedError(
        "the vllm_omni backend is not implemented yet; replica.backend=diffusers runs on CPU and GPU"
    )
