"""Why DiffusionNFT falls back after its peak on the shapes world: one run of the benchmark's diffusion_nft variant,
15 training minutes, evaluated every 2.5 minutes on the held-out and the train prompts (8 fixed seeds each), the
trainer's per-step metrics.csv kept beside eval.csv.

    .venv/bin/python research/diffusion_nft_fall/probe.py <out folder>
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]

from bench_learning import run_variant  # noqa: E402

out = Path(sys.argv[1])
run_variant("diffusion_nft", ["algorithm=diffusion_nft"], minutes=15, max_steps=1000, eval_every_minutes=2.5, seed=0,
            work=out, splits=["held_out", "train"], samples=8, keep_weights=None)
print(f"eval.csv and metrics.csv: {out / 'diffusion_nft-seed0' / 'out'}")
