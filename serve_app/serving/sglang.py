"""SGLang-Diffusion's rollout API (`POST /rollout/generate`, sglang.multimodal_gen post_training), answered by
this service, for trainers written against it (the miles / slime diffusion trainer).

A request is one prompt and its outputs; it maps onto a RolloutRequest (one group) field by field, and a
field this service cannot honour is a 422 naming it, never ignored. The answer is SGLang's layout and
encoding: one msgpack list, a dict per output, each tensor ``{"__tensor__": true, "data": <base64 of a
safetensors file holding one tensor "t">, "shape", "dtype"}``. docs/http.md maps every field.
"""

from __future__ import annotations

import base64
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from serve_app.errors import InvalidRequestError
from serve_app.flowgrpo.sde import SDE_TYPES
from serve_app.api import RolloutRequest
from serve_app.schemas import PromptEmbeds, TrajectoryBatch
from serve_app.wire.container import pack

SGLANG_MEDIA_TYPE = "application/msgpack"


class SglangRolloutRequest(BaseModel):
    """SGLang-Diffusion's RolloutRequest fields (docs/http.md says what each means here). Unknown fields are
    refused (SGLang ignores them: a misspelt setting would run with its default)."""

    model_config = ConfigDict(extra="forbid")

    prompt: StrictStr
    negative_prompt: StrictStr | None = None
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    generator_device: StrictStr | None = Field(
        None, description="Accepted; a sample's noise here comes from its seed on the CPU, whatever the device.")
    width: StrictInt | None = None
    height: StrictInt | None = None
    num_inference_steps: StrictInt | None = None
    num_outputs_per_prompt: StrictInt | None = Field(None, ge=1)
    guidance_scale: StrictFloat | StrictInt | None = None
    true_cfg_scale: StrictFloat | StrictInt | None = None
    num_frames: StrictInt | None = None
    fps: StrictInt | None = None
    rollout: StrictBool = True
    rollout_sde_type: StrictStr = "sde"
    rollout_noise_level: StrictFloat | StrictInt = 0.7
    rollout_log_prob_no_const: StrictBool = False
    rollout_debug_mode: StrictBool = False
    rollout_return_denoising_env: StrictBool = False
    rollout_return_dit_trajectory: StrictBool = False
    rollout_sde_step_indices: list[StrictInt] | None = None
    rollout_return_step_indices: list[StrictInt] | None = None
    image_path: list[StrictStr] | None = None
    suppress_logs: StrictBool = False
    extra_sampling_params: dict[str, Any] | None = None


def sglang_request(request: SglangRolloutRequest) -> RolloutRequest:
    """The RolloutRequest an SGLang request asks for.

    Raises:
        InvalidRequestError: a field this service cannot honour, named, with what it does instead.
    """
    _refuse_unhonoured(request)
    sampling: dict[str, Any] = {}
    for ours, theirs in (("negative_prompt", "negative_prompt"), ("width", "width"), ("height", "height"),
                         ("num_steps", "num_inference_steps"), ("num_frames", "num_frames")):
        value = getattr(request, theirs)
        if value is not None:
            sampling[ours] = value
    guidance = _guidance(request)
    if guidance is not None:
        sampling["guidance_scale"] = guidance
    if request.rollout:
        if request.rollout_sde_type not in SDE_TYPES:
            raise InvalidRequestError(f"must be one of {', '.join(SDE_TYPES)}; got {request.rollout_sde_type!r}", "rollout_sde_type")
        sampling.update(sde_type=request.rollout_sde_type, noise_level=float(request.rollout_noise_level),
                        **_window(request.rollout_sde_step_indices))
    else:  # SGLang's evaluation mode: plain generation, no trajectory
        sampling.update(sde_type="ode", noise_level=0.0, sde_window_size=None, sde_window_range=(0, 1))
    return RolloutRequest(prompts=[request.prompt], group_size=request.num_outputs_per_prompt or 1,
                          sampling=sampling, seed=request.seed)


def _refuse_unhonoured(request: SglangRolloutRequest) -> None:
    refusals = {
        "fps": (request.fps is not None, "is not used here: frames come back as tensors, not a video file"),
        "image_path": (request.image_path is not None, "server-side paths are not read; send input images in "
                       "`images` of POST /v1/rollouts"),
        "extra_sampling_params": (bool(request.extra_sampling_params), "is not taken; every setting this service "
                                  "honours is a field of POST /v1/rollouts' sampling"),
        "rollout_log_prob_no_const": (request.rollout_log_prob_no_const, "log-probs here keep the Gaussian's "
                                      "constants (the mean over elements of the full log-density)"),
        "rollout_debug_mode": (request.rollout_debug_mode, "this service records no per-step debug tensors (means, "
                               "noises, model outputs)"),
    }
    for field, (refused, why) in refusals.items():
        if refused:
            raise InvalidRequestError(why, field)
    if request.rollout_return_step_indices is not None and request.rollout_return_step_indices != sorted(
            set(request.rollout_sde_step_indices or [])):
        raise InvalidRequestError("the trajectory holds the latents of the SDE steps only; send it equal to "
                                  "rollout_sde_step_indices, or leave it out", "rollout_return_step_indices")


def _guidance(request: SglangRolloutRequest) -> float | None:
    """One guidance scale here, true CFG: true_cfg_scale, or guidance_scale when it is sent alone."""
    given = {name: float(v) for name, v in (("true_cfg_scale", request.true_cfg_scale),
                                             ("guidance_scale", request.guidance_scale)) if v is not None}
    if len(set(given.values())) > 1:
        raise InvalidRequestError("differs from true_cfg_scale; this service runs one guidance, true CFG "
                                  "(a guidance-distilled model's embedded guidance is the app's model.distilled_guidance)",
                                  "guidance_scale")
    return next(iter(given.values()), None)


def _window(indices: list[int] | None) -> dict[str, Any]:
    """The SDE window of SGLang's step indices: consecutive steps (the window starts exactly at the first);
    None makes every step but the last stochastic (the last is deterministic here)."""
    if indices is None:
        return {"sde_window_size": None, "sde_window_range": (0, 1)}
    steps = sorted(set(indices))
    if not steps or steps[0] < 0 or steps != list(range(steps[0], steps[0] + len(steps))):
        raise InvalidRequestError(f"must be consecutive steps from 0 (an SDE window); got {indices}",
                                  "rollout_sde_step_indices")
    return {"sde_window_size": len(steps), "sde_window_range": (steps[0], steps[0] + 1)}


def sglang_answer(request: SglangRolloutRequest, batch: TrajectoryBatch) -> bytes:
    """SGLang's answer for `batch` (transitions and images fetched): a msgpack list, a dict per output."""
    import msgpack

    trajectory = batch.trajectory
    images = trajectory.images.float() / 255.0  # SGLang sends decoded frames as floats in [0, 1]
    steps = len(trajectory.sigmas) - 1
    log_probs = torch.zeros(len(batch), steps, dtype=torch.float32)  # 0 on deterministic steps, as SGLang's
    log_probs[:, trajectory.step_indices] = trajectory.log_probs
    kept = torch.cat([trajectory.step_indices, trajectory.step_indices[-1:] + 1]) if len(trajectory.step_indices) \
        else trajectory.step_indices
    answers = []
    for i in range(len(batch)):
        answer: dict[str, Any] = {
            "request_id": batch.request_id, "prompt": request.prompt, "seed": trajectory.sampling.seed,
            "generated_output": _tensor(images[i]),
            "rollout_log_probs": _tensor(log_probs[i]) if request.rollout else None,
            "rollout_debug_tensors": None, "denoising_env": None, "dit_trajectory": None,
            "inference_time_s": batch.metrics.get("rollout_seconds"), "peak_memory_mb": None,
        }
        if request.rollout and request.rollout_return_dit_trajectory:
            answer["dit_trajectory"] = {
                "latents": _tensor(trajectory.latents[i]), "timesteps": _tensor(trajectory.sigmas[kept] * 1000.0),
                "sigmas": _tensor(trajectory.sigmas), "latent_step_indices": _tensor(kept),
            }
        if request.rollout_return_denoising_env:
            row = int(trajectory.embed_row[i])
            negative = trajectory.negative_embeds
            answer["denoising_env"] = {
                "pos_cond_kwargs": _conditioning(trajectory.prompt_embeds, row),
                "neg_cond_kwargs": None if negative is None else _conditioning(negative, row if negative.has_images else 0),
                "image_kwargs": None, "guidance": None,
            }
        answers.append(answer)
    return msgpack.packb(answers, use_bin_type=True)


def _conditioning(embeds: PromptEmbeds, row: int) -> dict[str, Any]:
    """One row of conditioning, trimmed to its real tokens, under the DiT forward's argument names."""
    length = int(embeds.mask[row].sum())
    found: dict[str, Any] = {"encoder_hidden_states": [_tensor(embeds.embeds[row, :length])], "txt_seq_lens": [length]}
    if embeds.pooled is not None:
        found["pooled_projections"] = [_tensor(embeds.pooled[row])]
    if embeds.image_latents is not None and embeds.image_shapes is not None:
        tokens = int(embeds.image_shapes[row].prod(dim=-1).sum())
        found["image_latents"] = [_tensor(embeds.image_latents[row, :tokens])]
    if embeds.image_embeds is not None:
        found["encoder_hidden_states_image"] = [_tensor(embeds.image_embeds[row])]
    return found


def _tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """SGLang's tensor encoding: a safetensors file of one tensor named "t", base64."""
    tensor = tensor.detach().contiguous()
    return {"__tensor__": True, "data": base64.b64encode(pack({"t": tensor}, None)).decode("ascii"),
            "shape": list(tensor.shape), "dtype": str(tensor.dtype)}
