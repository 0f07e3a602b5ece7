"""The update of one training step: replay every window transition of a batch with the current weights
(sampler.replay_step, the code the rollout ran), r = exp(logp - logp_old) against the stored behaviour
log-probs, the clipped loss + beta * KL, AdamW. Before anything changes, two checks: a sample of the batch
replayed with the weights of the version that sampled it must give the rollout's log-probs (the mismatch
monitor, at any staleness), and on a batch sampled with these very weights the first replay must give
ratio 1.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from serve_app.flowgrpo.sampler import replay_step
from serve_app.flowgrpo.sde import kl_between_means
from serve_app.policies.base import DiffusionPolicy
from serve_app.schemas import Trajectory
from serve_app.trainer.config import TrainerSection
from serve_app.trainer.ema import new_ema
from serve_app.trainer.faults import crash_point
from serve_app.trainer.lora import TrainableTransformer
from serve_app.trainer.loss import (clipped_ratio_loss, clipped_surrogate, grpo_guard_step_weight, loss_stats,
                                    nft_loss, nft_optimality, ratio_norm_log_ratio)
from serve_app.trainer.nft import (ForwardDraws, check_velocity, conditional_velocity, final_latents,
                                  forward_generators, sampling_decay)
from serve_app.trainer.mismatch import MismatchMonitor
from serve_app.trainer.parallel import DataParallel, scalar


class TrainingDivergedError(RuntimeError):
    """A non-finite loss or gradient: training stops before the weights or the checkpoint change."""


class OnPolicyMismatchError(RuntimeError):
    """The first replay after a rollout did not give ratio 1: trainer and replicas hold different weights."""


@dataclass
class UpdateStats:
    losses: list[float] = field(default_factory=list)
    kls: list[float] = field(default_factory=list)
    approx_kls: list[float] = field(default_factory=list)
    clip_fracs: list[float] = field(default_factory=list)
    ratios: list[torch.Tensor] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    onpolicy_ratio_dev: float = 0.0
    onpolicy_ratio_dev_by_rank: list[float] = field(default_factory=list)
    checks: dict[str, float] = field(default_factory=dict)  # an algorithm's own trust checks, for metrics.csv

    @staticmethod
    def merged(parts: list[UpdateStats]) -> UpdateStats:
        """The ranks' stats as one (for rank 0's metrics row): per-micro-batch values of every rank, the
        gradient norms and the on-policy deviations every rank already shares."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        return UpdateStats(
            losses=[v for p in parts for v in p.losses], kls=[v for p in parts for v in p.kls],
            approx_kls=[v for p in parts for v in p.approx_kls], clip_fracs=[v for p in parts for v in p.clip_fracs],
            ratios=[r for p in parts for r in p.ratios], grad_norms=first.grad_norms,
            onpolicy_ratio_dev=first.onpolicy_ratio_dev, onpolicy_ratio_dev_by_rank=first.onpolicy_ratio_dev_by_rank,
            checks={k: max(p.checks[k] for p in parts) for k in first.checks},
        )


@dataclass(frozen=True)
class MicroBatch:
    """Rows of one micro-batch, the factor of each window step's loss, and whether an optimizer step follows it."""

    rows: torch.Tensor
    scale: float
    steps: bool


def accumulation(micro_batches: Sequence[torch.Tensor], grad_accum: int | None, *, window: int,
                 ranks: int) -> list[MicroBatch]:
    """The micro-batches of one pass, `grad_accum` to an optimizer step (None: all of them). Every row of an
    optimizer step weighs the same, 1 / (window x the step's rows on all `ranks`; shards are equal): summed over
    ranks, the gradients are the one-process gradient of the whole batch (one process: ranks 1)."""
    accum = grad_accum or len(micro_batches)
    planned = []
    for i, rows in enumerate(micro_batches):
        group_start = (i // accum) * accum
        group_end = min(group_start + accum, len(micro_batches))
        step_rows = sum(len(r) for r in micro_batches[group_start:group_end]) * ranks
        planned.append(MicroBatch(rows, len(rows) / (window * step_rows), i + 1 == group_end))
    return planned


class PolicyUpdate:
    """The trainable weights, their optimizer (and EMA) and the step that changes them.

    Args:
        cfg: the trainer section (lr, clip range, beta, micro-batches, tolerances).
        policy: the trainer's copy of the policy; its transformer gets the trainable adapter.
        parallel: this process's rank (the whole update runs on every rank, on its shard).
        history: the metric rows logged so far; a divergence names the last finite one.
    """

    def __init__(self, cfg: TrainerSection, policy: DiffusionPolicy, parallel: DataParallel, *,
                 history: Sequence[dict[str, float]] = ()) -> None:
        self.cfg = cfg
        self.policy = policy
        self.parallel = parallel
        self.history = history
        # The trainable tensors of the versions a batch may still come from: this one and max_staleness before it
        # (none at max_staleness 0: every batch then comes from the weights the trainer holds).
        keep = cfg.max_staleness + 1 if cfg.max_staleness else 0
        if cfg.averages_sampling:  # the version sampled is an average, never the trained weights: always kept
            keep = cfg.max_staleness + 1
        self.model = TrainableTransformer(policy, cfg.lora, keep_versions=keep)
        parallel.prepare(self.model)  # before the optimizer: fsdp replaces the parameters
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.mismatch = MismatchMonitor(**cfg.mismatch.model_dump())  # rollout-vs-replay, every step
        self._behaviour_means: list[torch.Tensor] | None = None  # GRPO-Guard: set by run()
        # The EMA of the trained tensors, evaluated in place of the raw weights (trainer.ema_decay); rank 0 only.
        self.ema = (new_ema(self.model.parameters(), cfg.ema_decay)
                    if cfg.ema_decay and parallel.is_leader else None)

    def sampled_with(self, trajectory: Trajectory, *, current: bool) -> contextlib.AbstractContextManager[None]:
        """The weights that sampled `trajectory`, held for a block: the current ones when `current` (and they are the
        ones published), else the kept tensors of its version (a batch in flight during updates, or DiffusionNFT's
        soft-updated sampling policy)."""
        if current and not self.cfg.averages_sampling:
            return contextlib.nullcontext()
        return self.model.at_version(trajectory.policy_version)

    def next_sampling_state(self, update: int, version: int) -> dict[str, torch.Tensor] | None:
        """With a soft-updated sampling policy, the tensors to publish after update `update` (0-based): d x the kept
        tensors of `version`, the sampling policy so far, + (1 - d) x the trained ones (d: nft.sampling_decay);
        None otherwise (the trained weights are published)."""
        if not self.cfg.averages_sampling:
            return None
        decay = sampling_decay(self.cfg.diffusion_nft, update)
        old, trained = self.model.version_state(version), self.model.local_state()
        return {name: decay * old[name] + (1.0 - decay) * tensor for name, tensor in trained.items()}

    def run(self, trajectory: Trajectory, advantages: torch.Tensor, *, check_onpolicy: bool, seed: int,
            step: int) -> UpdateStats:
        """inner_epochs passes over the batch in micro-batches (drawn with `seed`), every window step k of each
        row, after the mismatch check of a sample of it (`check_behaviour`); with `check_onpolicy` the first replay
        must give ratio 1 (the batch was sampled with these weights)."""
        if self.cfg.algorithm == "diffusion_nft":
            return self._run_nft(trajectory, advantages, current=check_onpolicy, seed=seed, step=step)
        cfg, stats = self.cfg, UpdateStats()
        if not check_onpolicy:
            stats.onpolicy_ratio_dev = math.nan  # not measured: the batch was sampled with older weights
        batch, window = len(trajectory), trajectory.log_probs.shape[1]
        if window == 0:
            raise ValueError("the rollout has no stochastic steps (sde_type 'ode' or noise_level 0): nothing to train")
        self.check_behaviour(trajectory, seed=seed, current=check_onpolicy)
        # GRPO-Guard normalises each ratio with the behaviour policy's transition means: computed once, before
        # anything changes, with the weights that sampled the batch.
        self._behaviour_means = self._behaviour_means_of(trajectory, current=check_onpolicy) if cfg.grpo_guard else None
        generator = torch.Generator().manual_seed(seed)
        for expert in self.model.experts.values():
            expert.train()
        for _epoch in range(cfg.inner_epochs):
            micro_batches = torch.randperm(batch, generator=generator).split(cfg.micro_batch_size)
            self.optimizer.zero_grad(set_to_none=True)
            for micro in accumulation(micro_batches, cfg.grad_accum, window=window, ranks=self.parallel.world_size):
                first_replay = check_onpolicy and not stats.grad_norms  # before the first optimizer step
                for k in range(window):
                    loss = self._micro_loss(trajectory, advantages, k, micro.rows, stats, step, on_policy=first_replay)
                    (loss * micro.scale).backward()
                if micro.steps:
                    if first_replay:
                        self.check_onpolicy(stats, step, trajectory.policy_version)
                    self._optimizer_step(stats, step)
        for expert in self.model.experts.values():
            expert.eval()
        return stats

    def _run_nft(self, trajectory: Trajectory, advantages: torch.Tensor, *, current: bool, seed: int,
                 step: int) -> UpdateStats:
        """DiffusionNFT's update: `draws` forward-process points of every rollout's final latents per pass, the
        sampling version's velocity there (v_old, under no grad, before anything changes), and nft_loss against the
        trained velocity. First its trust check: the weights of the version that sampled the batch (the current ones when
        `current`) must give `check_rows` of its rollouts the first step they were sampled with (check_velocity)."""
        cfg, nft = self.cfg, self.cfg.diffusion_nft
        stats = UpdateStats(onpolicy_ratio_dev=math.nan)  # no ratio: the velocity check stands in for it
        x0 = final_latents(trajectory)
        batch = len(trajectory)
        generator = torch.Generator().manual_seed(seed)
        behaviour = self.sampled_with(trajectory, current=current)
        draws = [ForwardDraws.of(x0, nft.draws, nft.t_range, forward_generators(seed, epoch, trajectory.seeds))
                 for epoch in range(cfg.inner_epochs)]
        with behaviour:
            if nft.check_rows:
                rows = torch.randperm(batch, generator=generator)[: nft.check_rows]
                error = check_velocity(self.policy, trajectory, rows, bound=nft.max_velocity_error)
                stats.checks["nft_velocity_error"] = max(self.parallel.all_gather(error))
            with torch.no_grad():
                old = [self._nft_velocities(trajectory, d) for d in draws]
        optimality = nft_optimality(advantages, nft.advantage_clip)
        for expert in self.model.experts.values():
            expert.train()
        for epoch in range(cfg.inner_epochs):
            drawn = draws[epoch]
            micro_batches = torch.randperm(batch, generator=generator).split(cfg.micro_batch_size)
            self.optimizer.zero_grad(set_to_none=True)
            for micro in accumulation(micro_batches, cfg.grad_accum, window=nft.draws, ranks=self.parallel.world_size):
                for d in range(nft.draws):
                    t = drawn.t[micro.rows, d]
                    v = conditional_velocity(self.policy, trajectory, drawn.x_t[micro.rows, d], t, micro.rows)
                    loss = nft_loss(v, old[epoch][micro.rows, d].to(v.device), drawn.v_target[micro.rows, d].to(v.device),
                                    optimality[micro.rows].to(v.device), beta=nft.beta,
                                    t=t.to(v.device) if nft.adaptive_weighting else None)
                    if not torch.isfinite(loss):
                        raise self._diverged(f"loss {float(loss.detach())} at forward draw {d}", step)
                    (loss * micro.scale).backward()
                    stats.losses.append(float(loss.detach()))
                if micro.steps:
                    self._optimizer_step(stats, step)
        for expert in self.model.experts.values():
            expert.eval()
        return stats

    def _nft_velocities(self, trajectory: Trajectory, drawn: ForwardDraws) -> torch.Tensor:
        """[B, D, ...] the policy's velocity at every forward draw, in micro-batches, on the CPU."""
        per_draw = []
        for d in range(drawn.t.shape[1]):
            parts = [conditional_velocity(self.policy, trajectory, drawn.x_t[rows, d], drawn.t[rows, d], rows).cpu()
                     for rows in torch.arange(len(trajectory)).split(self.cfg.micro_batch_size)]
            per_draw.append(torch.cat(parts))
        return torch.stack(per_draw, dim=1)

    def _micro_loss(self, trajectory: Trajectory, advantages: torch.Tensor, k: int, rows: torch.Tensor,
                    stats: UpdateStats, step: int, *, on_policy: bool) -> torch.Tensor:
        cfg = self.cfg
        new = replay_step(self.policy, trajectory, k, rows=rows)
        old_log_prob = trajectory.log_probs[rows, k].to(new.log_prob.device)
        # With trainer.mismatch.tis_cap: the trainer's pre-update log-prob, and TIS-weighted advantages.
        old_log_prob, weighted = self.mismatch.correct(rows, k, old_log_prob, advantages[rows].to(new.log_prob.device))
        policy_loss, raw_ratio = clipped_ratio_loss(new.log_prob, old_log_prob, weighted, cfg.clip_range)
        ratio = raw_ratio
        if self._behaviour_means is not None:  # GRPO-Guard: the normalised ratio, each step's loss weighted by 1 / |dt|
            old_mean = self._behaviour_means[k][rows].to(new.mean.device)
            ratio = torch.exp(ratio_norm_log_ratio(new.log_prob, old_log_prob, new.mean, old_mean, new.std.flatten(1)[:, 0]))
            step_weight = grpo_guard_step_weight(trajectory.sigmas, int(trajectory.step_indices[k]))
            policy_loss = clipped_surrogate(ratio, weighted, cfg.clip_range) * step_weight
        if on_policy:  # checked against the tolerance before the first optimizer step (check_onpolicy)
            deviation = float((raw_ratio.detach() - 1.0).abs().max())
            stats.onpolicy_ratio_dev = max(stats.onpolicy_ratio_dev, deviation)
        kl = torch.zeros((), device=policy_loss.device)
        if cfg.beta > 0:
            # The reference runs without grad; the KL's gradient flows through new.mean only.
            with torch.no_grad(), self.model.reference():
                ref = replay_step(self.policy, trajectory, k, rows=rows)
            kl = kl_between_means(new.mean, ref.mean, new.std).mean()
        loss = policy_loss + cfg.beta * kl
        if not torch.isfinite(loss):
            raise self._diverged(
                f"loss {float(loss.detach())} (policy loss {float(policy_loss.detach())}, kl {float(kl.detach())}) "
                f"at window step {k}", step
            )
        s = loss_stats(new.log_prob, old_log_prob, ratio, cfg.clip_range)
        stats.losses.append(float(loss.detach()))
        stats.kls.append(float(kl.detach()))
        stats.approx_kls.append(s.approx_kl)
        stats.clip_fracs.append(s.clip_frac)
        stats.ratios.append(ratio.detach().cpu())
        return loss

    @torch.no_grad()
    def _behaviour_means_of(self, trajectory: Trajectory, *, current: bool) -> list[torch.Tensor]:
        """[B, ...] transition means of every window step k under the weights that sampled the batch (the current
        ones when `current`, else that version's kept tensors), replayed in micro-batches."""
        rows = torch.arange(len(trajectory)).split(self.cfg.micro_batch_size)
        with self.sampled_with(trajectory, current=current):
            return [torch.cat([replay_step(self.policy, trajectory, k, rows=r).mean.cpu() for r in rows])
                    for k in range(trajectory.log_probs.shape[1])]

    def check_behaviour(self, trajectory: Trajectory, *, seed: int, current: bool) -> None:
        """Replay a sample of this rank's rows (trainer.mismatch.check_groups whole groups drawn with `seed`; every
        row with TIS) under no grad with the weights of the version that sampled them: the current ones when
        `current`, else that version's kept trainable tensors, swapped in for the replay and out after. The ranks
        exchange their log ratios, so with action "stop" a mismatch on any rank stops all of them before an
        optimizer step."""
        self.mismatch.check(self.policy, trajectory, seed=seed, micro_batch_size=self.cfg.micro_batch_size,
                            behaviour=self.sampled_with(trajectory, current=current), gather=self.parallel.all_gather)

    def check_onpolicy(self, stats: UpdateStats, step: int, version: int) -> None:
        """Every rank's first replay must give ratio 1 on its rows; the ranks exchange their deviations, so a
        mismatch on any rank stops all of them before an optimizer step (nothing changes, nothing is published)."""
        cfg, world = self.cfg, self.parallel.world_size
        stats.onpolicy_ratio_dev_by_rank = by_rank = self.parallel.all_gather(stats.onpolicy_ratio_dev)
        stats.onpolicy_ratio_dev = deviation = max(by_rank)
        if deviation > cfg.onpolicy_tolerance:
            ranks = [r for r, d in enumerate(by_rank) if d > cfg.onpolicy_tolerance]
            where = f" on rank(s) {ranks} of {world}" if world > 1 else ""
            raise OnPolicyMismatchError(
                f"step {step}: replaying the rollout of version {version} before any update gives |ratio - 1| = {deviation:.3g}{where} > "
                f"trainer.onpolicy_tolerance {cfg.onpolicy_tolerance}; the replicas' weights, sampling settings or "
                "precision differ from the trainer's"
            )

    def _optimizer_step(self, stats: UpdateStats, step: int) -> None:
        self.parallel.reduce_gradients(self.model.parameters())
        grad_norm = scalar(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip_norm))
        if not math.isfinite(grad_norm):
            raise self._diverged(f"gradient norm {grad_norm}", step)
        stats.grad_norms.append(grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.step(self.model.parameters())
        if len(stats.grad_norms) == 1:  # the update's first optimizer step is done
            crash_point("update", step)

    def _diverged(self, what: str, step: int) -> TrainingDivergedError:
        last = self.history[-1] if self.history else None
        finite = (
            f"last finite values (step {int(last['step'])}): loss {last['loss']:.6g}, reward_mean {last['reward_mean']:.6g}, "
            f"ratio_max {last['ratio_max']:.6g}, policy_version {int(last['policy_version'])}"
            if last else "no finite step before it"
        )
        return TrainingDivergedError(
            f"non-finite {what} at step {step}; stopped before the optimizer step, the checkpoint is left as it "
            f"was; {finite}"
        )
