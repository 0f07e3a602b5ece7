"""Why DiffusionNFT falls back after its peak on the shapes world: one run of a bench_learning variant
(default diffusion_nft; diffusion_nft_soft samples a soft-updated average of the trained weights), 15 training
minutes, evaluated every 2.5 minutes on the held-out and the train prompts (8 fixed seeds each), the trainer's
per-step metrics.csv kept beside eval.csv.

    .venv/bin/python research/diffusion_nft_fall/probe.py <out folder> [variant]
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]

from bench_learning import VARIANTS, run_variant  # noqa: E402

out = Path(sys.argv[1])
variant = sys.argv[2] if len(sys.argv) > 2 else "diffusion_nft"
run_variant(variant, VARIANTS[variant], minutes=15, max_steps=1000, eval_every_minutes=2.5, seed=0,
            work=out, splits=["held_out", "train"], samples=8, keep_weights=None)
print(f"eval.csv and metrics.csv: {out / f'{variant}-seed0' / 'out'}")
