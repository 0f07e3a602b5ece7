"""What the sampler benchmarks share (bench_sampler.py on the CPU, gpu_rollout.py on one CUDA device):
our sampler's variants, one rollout of ours as the service runs it, a clock that waits for the device,
interleaved timing against the stock pipeline, and how times and ratios are summarised.

Not a script: the benchmark scripts import it as a sibling module.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from serve_app.flowgrpo.sampler import SamplingPolicy, encode_conditioning, rollout
from serve_app.config.sampling import SamplingParams
from serve_app.schemas import PromptTokens, Trajectory

# The window's first step in every timed SDE-window rollout (a fixed start keeps repeats comparable).
WINDOW_START = 1

# Our sampler's variants, as changes to the shared base settings.
VARIANTS: dict[str, dict] = {
    "ours_ode": {"noise_level": 0.0, "sde_type": "ode", "sde_window_size": None},
    "ours_sde_window2": {"noise_level": 1.2, "sde_window_size": 2, "sde_window_range": (0, 5)},
    "ours_sde_all_steps": {"noise_level": 1.2, "sde_window_size": None},
}

STOCK = "stock_pipeline"


def sampler_variants(base: SamplingParams, names: Sequence[str]) -> dict[str, SamplingParams]:
    """name -> `base` with that variant's settings (VARIANTS)."""
    return {name: base.model_copy(update=VARIANTS[name]) for name in names}


def our_rollout(policy: SamplingPolicy, tokens: Sequence[PromptTokens], params: SamplingParams,
                seeds: torch.Tensor, *, window_start: int = WINDOW_START) -> Trajectory:
    """len(seeds) samples of the one prompt `tokens` holds, as a replica samples them: the prompt
    encoded (part of the work, as in the stock call), then our rollout."""
    index = torch.zeros(len(seeds), dtype=torch.long)
    conditioning = encode_conditioning(policy, tokens, index.to(policy.device), None, params)
    return rollout(policy, conditioning, seeds, params, window_start=window_start if params.sde_window_size else None,
                   prompt_index=index, sample_index=seeds, policy_version=0, weights_hash="base")


@dataclass(frozen=True)
class Measurement:
    seconds: float
    peak_memory_bytes: int | None  # the device's peak allocation during the call (None on the CPU)
    result: object = None  # what the call returned


class Clock:
    """Times a call on `device`: on a CUDA device it synchronizes before and after (kernels run
    asynchronously) and reads the peak memory allocated during the call."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def measure(self, fn: Callable[[], object]) -> Measurement:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        result = fn()
        if self.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        return Measurement(seconds, torch.cuda.max_memory_allocated() if self.cuda else None, result)


def time_interleaved(runs: dict[str, Callable[[], object]], repeats: int, clock: Clock) -> dict[str, list[Measurement]]:
    """Each run `repeats` times, interleaved so that machine noise hits every run alike (warm up first)."""
    measured: dict[str, list[Measurement]] = {name: [] for name in runs}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, fn in runs.items():
                measured[name].append(clock.measure(fn))
    return measured


def summary(samples: Sequence[float]) -> dict[str, float]:
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples)}


def ratio_summary(times: Sequence[float], reference: Sequence[float]) -> dict[str, float]:
    """times / reference: per repeat (min / median / max) and of the two medians."""
    per_repeat = [a / b for a, b in zip(times, reference)]
    return {**summary(per_repeat), "of_medians": statistics.median(times) / statistics.median(reference)}


def seconds_of(measurements: Sequence[Measurement]) -> list[float]:
    return [m.seconds for m in measurements]
