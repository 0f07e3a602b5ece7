"""model.compile: the sampling engine runs its transformer compiled (torch.compile, inductor), the
trainer's replay stays eager, and the two agree closely enough for the ratio check to hold.

Measured here (tiny SD3, torch 2.13 on 2 CPU cores, inductor with gcc; 30-60 s for the first compiled
rollout with a cold inductor cache, ~6 s with a warm one): the compiled rollout's log-probs differ from
the eager rollout's of the same seeds by 1.2e-7 at most and its window latents by 2.4e-6 (fused kernels
round differently); the eager trainer's replay of the compiled rollout reproduces its log-probs to
1.2e-7, inside the engine contract's REPLAY_TOLERANCE (1e-6). The tolerances below keep ~10x margin.
"""

from __future__ import annotations

import pytest
import torch

from serve_app.flowgrpo.sampler import sample_group
from serve_app.schemas import SamplingParams
from serve_app.serving.engine import load_engine
from serve_app.serving.engine_contract import REPLAY_TOLERANCE, replay_verdict
from serve_app.trainer.config import load_trainer_config
from serve_app.trainer.loop import load_trainer_policy

OVERRIDES = ["model=tiny_sd3", "model.compile=true"]
# Few steps and a group of 2: compilation dominates the test's time, sampling is cheap.
PARAMS = SamplingParams(num_steps=3, guidance_scale=4.0, noise_level=1.2, sde_window_size=2, sde_window_range=(0, 1),
                        seed=7)

LOG_PROB_TOLERANCE = 1e-6  # measured 1.2e-7
LATENT_TOLERANCE = 3e-5  # measured 2.4e-6


@pytest.fixture(scope="module")
def config(flowgrpo_home):
    return load_trainer_config("trainer/flowgrpo", OVERRIDES)


# One engine and one trainer policy for the module (loading tiny SD3's three text encoders is most of
# the first test's time): the first test only reads their flags, the second samples without changing them.
@pytest.fixture(scope="module")
def engine(config):
    return load_engine(config)


@pytest.fixture(scope="module")
def trainer_policy(config):
    return load_trainer_policy(config)


def test_the_engine_compiles_its_transformer_and_the_trainer_does_not(engine, trainer_policy):
    assert engine.policy.compiled
    assert not trainer_policy.compiled


@pytest.mark.slow
def test_compiled_rollouts_agree_with_eager_ones_and_replay_under_the_eager_trainer_policy(engine, trainer_policy):
    compiled_policy = engine.policy
    tokens = trainer_policy.text_processor().tokenize(["a red circle", "two blue squares"])
    eager = sample_group(trainer_policy, tokens, 2, PARAMS, policy_version=0)
    compiled = sample_group(compiled_policy, tokens, 2, PARAMS, policy_version=0)
    log_prob_gap = float((compiled.log_probs - eager.log_probs).abs().max())
    latent_gap = float((compiled.latents - eager.latents).abs().max())
    print(f"compiled vs eager: log-probs {log_prob_gap:.3g}, latents {latent_gap:.3g}")
    assert log_prob_gap <= LOG_PROB_TOLERANCE and latent_gap <= LATENT_TOLERANCE

    verdict = replay_verdict(trainer_policy, compiled, tolerance=REPLAY_TOLERANCE)  # measured 1.2e-7
    print(verdict.message)
    assert verdict.ok, verdict.message

    # The health probe's one-off shape runs eager: compiling it could outlast Serve's health-check timeout.
    with torch.compiler.set_stance("fail_on_recompile"):
        engine.check_health()
