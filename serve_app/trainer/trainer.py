"""The reference FlowGRPO trainer: rollouts by DeploymentHandle, a clipped-ratio update on its own
copy of the policy, and a version-pinned weight sync through the version store (weights.transport).

One training step, top to bottom:

    1. rollout  - the next batch from the RolloutPipeline: sampled at version v' <= v, stamped with
                  v' and the content hash of the weights the replicas checked they held
    2. prefill  - with trainer.max_staleness k > 0, k more rollouts are sent (pinned to v) to run
                  while this update does
    3. update   - replay every window transition with the current weights (sampler.replay_step, the
                  code the rollout ran), r = exp(logp - logp_old) with the stored behaviour log-probs,
                  clipped loss + beta * KL, AdamW; at staleness 0 the first replay must give r == 1
    4. publish  - store.publish(v + 1, adapter tensors); new rollouts are pinned to it
    5. log      - one metrics.csv row; grids, evaluations and checkpoints every few steps

On N data-parallel ranks (trainer.distributed, serve_app.trainer.distributed) the same code runs on each:
rank 0 does 1, 2, 4 and 5 and sends every rank its shard of whole groups for 3; one process is world size 1.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from serve_app.errors import PolicyVersionError
from serve_app.flowgrpo.sampler import replay_step
from serve_app.flowgrpo.sde import kl_between_means
from serve_app.policies.base import DiffusionPolicy
from serve_app.rewards import TOTAL_KEY
from serve_app.schemas import SamplingParams, Trajectory, TrajectoryBatch
from serve_app.trainer.checkpoint import load_checkpoint, save_checkpoint
from serve_app.trainer.config import TrainerRunConfig
from serve_app.trainer.distributed import DataParallel, scalar
from serve_app.trainer.ema import EMAModel, averaged_weights
from serve_app.trainer.evaluation import RunEvaluator
from serve_app.trainer.lora import TrainableTransformer
from serve_app.trainer.loss import clipped_ratio_loss, loss_stats
from serve_app.trainer.mismatch import MismatchMonitor
from serve_app.trainer.outputs import MetricsLog, plot_reward_curve, save_image_grid
from serve_app.trainer.pipeline import Delivered, RolloutPipeline
from serve_app.trainer.telemetry import TrainerTelemetry
from serve_app.trainer.statistics import first_and_last, welch_t
from serve_app.weights import check_weights_hash, open_weight_store


class TrainingDivergedError(RuntimeError):
    """A non-finite loss or gradient: training stops before the weights or the checkpoint change."""


class OnPolicyMismatchError(RuntimeError):
    """The first replay after a rollout did not give ratio 1: trainer and replicas hold different weights."""


class RolloutSource(Protocol):
    def rollout(self, prompts: list[str], group_size: int, sampling: Any = None, policy_version: int | None = None,
                seed: int | None = None, *, timeout_s: float | None = None) -> TrajectoryBatch: ...


def load_trainer_policy(config: TrainerRunConfig) -> DiffusionPolicy:
    """The same checkpoint the app's replicas load (config.model), on this process's device."""
    from serve_app.policies import load_configured_policy

    return load_configured_policy(config.model)


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
        )


class FlowGRPOTrainer:
    """Trains a LoRA (or the whole transformer) against a deployed rollout app.

    Args:
        config: the run's config (the app must run the same model and weights_dir).
        client: a RolloutClient (or anything with its `rollout`).
        out_dir: outputs/<run>.
        policy: an already loaded policy (tests); default loads config.model.
        resume: a checkpoint directory to continue from.
        replica_handle: optional DiffusionReplica handle to push new versions ahead (trainer.prefetch).
        parallel: this process's rank in a data-parallel group (serve_app.trainer.distributed); default one
            process. Ranks other than 0 get no client: they replay the shards rank 0 sends, and write nothing.
    """

    def __init__(self, config: TrainerRunConfig, client: RolloutSource | None, out_dir: str | Path, *,
                 policy: DiffusionPolicy | None = None, resume: str | Path | None = None,
                 replica_handle: Any | None = None, progress: bool = True,
                 parallel: DataParallel | None = None) -> None:
        self.config = config
        self.cfg = config.trainer
        self.client = client
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.progress = progress
        self.replica_handle = replica_handle
        torch.manual_seed(self.cfg.seed)
        if self.cfg.torch_threads is not None:
            torch.set_num_threads(self.cfg.torch_threads)
        self.policy = policy if policy is not None else load_trainer_policy(config)
        self.model = TrainableTransformer(self.policy, self.cfg.lora)
        self.parallel = parallel if parallel is not None else DataParallel()
        self.parallel.prepare(self.model)  # before the optimizer: fsdp replaces the parameters
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.mismatch = MismatchMonitor(**self.cfg.mismatch.model_dump())  # rollout-vs-replay, always on
        self.store = open_weight_store(config)
        self.sampling: SamplingParams = config.sampling
        self.step = 0  # steps completed
        self.version = 0  # the version the trainer's weights equal (0 = base; a fresh adapter is a no-op)
        self.step_seconds: list[float] = []
        self.images_sampled = 0  # rollout images so far (evaluations not counted)
        self.total_steps = self.cfg.steps
        self.prompts = list(self.cfg.prompts)
        if self.cfg.shuffle_prompts:
            random.Random(self.cfg.seed).shuffle(self.prompts)
        # The EMA of the trained tensors, evaluated in place of the raw weights (trainer.ema_decay).
        leader = self.parallel.is_leader
        self.ema = EMAModel(self.model.parameters(), decay=self.cfg.ema_decay) if self.cfg.ema_decay and leader else None
        if resume is not None:
            self._resume(Path(resume))
        # The versions updates published, in order (EMA versions are evaluated, never trained from):
        # a batch's staleness is the number of updates since its version.
        self.policy_versions = [self.version]
        self.dropped_batches = 0
        self.pipeline = RolloutPipeline(self._request_rollout, max_staleness=self.cfg.max_staleness,
                                        first_index=self.step)
        self.telemetry = TrainerTelemetry.if_on_a_cluster() if leader else None
        self.metrics = MetricsLog(self.out / "metrics.csv", append=resume is not None and leader)
        self.evaluator = (RunEvaluator(config, client, self.out, append=resume is not None)
                          if self.cfg.eval_every and leader else None)
        if resume is not None:
            self.metrics.truncate_after(self.step - 1)
            self.step_seconds = [r["step_seconds"] for r in self.metrics.rows]
            self.images_sampled = len(self.metrics.rows) * self.cfg.prompts_per_step * self.cfg.group_size
            if self.evaluator is not None:
                self.evaluator.log.truncate_after(self.step)

    # -- the loop ---------------------------------------------------------------------------

    def train(self, steps: int | None = None) -> list[dict[str, float]]:
        """Run until `steps` (default trainer.steps) steps are done; returns the metric rows."""
        from tqdm import tqdm

        total = self.total_steps = steps if steps is not None else self.cfg.steps
        bar = tqdm(total=total, initial=self.step, desc="flowgrpo", disable=not self.progress, dynamic_ncols=True)
        if self.evaluator is not None and self.step == 0 and not self.evaluator.first_split_rows:
            self.evaluate()  # the model before training: eval.csv's step 0
        while self.step < total:
            row = self.train_step()
            bar.update(1)
            if row:  # rank 0 (the others log nothing)
                bar.set_postfix(reward=f"{row['reward_mean']:.4f}", ratio=f"{row['ratio_max']:.4f}", v=self.version)
            last = self.step == total
            if self.cfg.checkpoint_every and (self.step % self.cfg.checkpoint_every == 0) or last:
                self.save_checkpoint()
        bar.close()
        self.finish()
        return self.metrics.rows

    def train_step(self) -> dict[str, float]:
        """One step; returns its metrics row (an empty one on data-parallel ranks other than 0)."""
        step, cfg = self.step, self.cfg
        started = time.perf_counter()
        delivered, staleness = None, 0
        if self.parallel.is_leader:
            # 1. The next rollout, sampled at most max_staleness updates ago.
            delivered, staleness = self._next_rollout()
            # 2. The next rollouts run while this update does (none at staleness 0).
            self.pipeline.prefill(self.version)
        # 3. Update; the stored log-probs are the behaviour policy's, so at staleness > 0 the first ratio is not 1.
        # Each rank replays its shard of whole groups (one process: the whole batch).
        shard = self.parallel.scatter(None if delivered is None else delivered.batch, check_onpolicy=staleness == 0)
        train_started = time.perf_counter()
        stats = self._update(shard.trajectory, shard.advantages, check_onpolicy=shard.check_onpolicy)
        stats = UpdateStats.merged(self.parallel.all_gather(stats))
        train_s = time.perf_counter() - train_started
        # 4. Publish the new weights; rollouts sent from now on are pinned to them.
        sync_started = time.perf_counter()
        self.version = self.publish()
        self.policy_versions.append(self.version)
        weight_sync_s = time.perf_counter() - sync_started
        # 5. Log (rank 0).
        self.step += 1
        if delivered is None:
            self.mismatch.end()  # this rank's share is not logged
            return {}
        batch, trajectory = delivered.batch, delivered.batch.trajectory
        advantages = batch.advantages.float()  # clipped by the app (aggregator.advantage.clip), once
        row = self._row(step, batch, advantages, stats, delivered.sampling_seconds, train_s, weight_sync_s,
                        time.perf_counter() - started)
        row.update(self.mismatch.end())
        row.update(staleness=staleness, dropped_batches=self.dropped_batches,
                   trainer_idle_s=delivered.trainer_idle_seconds, rollout_wait_s=delivered.rollout_wait_seconds)
        if self.parallel.world_size > 1:  # every rank's own first-replay check
            row.update({f"onpolicy_ratio_dev_rank{r}": d for r, d in enumerate(stats.onpolicy_ratio_dev_by_rank)})
        if self.telemetry is not None:
            self.telemetry.record(row, trainer_version=self.version)
        if cfg.image_every and step % cfg.image_every == 0:
            save_image_grid(trajectory.images, self.out / f"train_step{step:05d}.png", columns=cfg.group_size)
        self.step_seconds.append(row["step_seconds"])
        self.images_sampled += len(batch)
        if self.evaluator is not None and (self.step % cfg.eval_every == 0 or self.step == self.total_steps):
            row["eval_reward_mean"] = self.evaluate()["eval_reward_mean"]
        self.metrics.append(row)
        return row

    def _next_rollout(self) -> tuple[Delivered, int]:
        """The oldest rollout in flight whose staleness is within max_staleness (older ones are dropped
        and counted), checked for the version it was pinned to and the weights it was sampled with."""
        while True:
            delivered = self.pipeline.take(self.version)
            batch = delivered.batch
            if batch.policy_version != delivered.version:
                raise PolicyVersionError(
                    f"rollout {delivered.index}: asked for policy version {delivered.version}, "
                    f"the rollout is stamped {batch.policy_version}"
                )
            check_weights_hash(batch.trajectory, self.store)
            staleness = len(self.policy_versions) - 1 - self.policy_versions.index(batch.policy_version)
            if staleness <= self.cfg.max_staleness:
                return delivered, staleness
            self.dropped_batches += 1

    def _request_rollout(self, index: int, version: int) -> TrajectoryBatch:
        """Rollout `index` (its prompts and seed) pinned to `version`; runs on a pipeline thread."""
        return self.client.rollout(
            self._prompts(index), self.cfg.group_size, sampling=self.sampling, policy_version=version,
            seed=self._request_seed(index), timeout_s=self.cfg.rollout_timeout_s,
        )

    def _update(self, trajectory: Trajectory, advantages: torch.Tensor, *, check_onpolicy: bool) -> UpdateStats:
        """inner_epochs passes over the batch in micro-batches, every window step k of each row; with
        `check_onpolicy` the first replay must give ratio 1 (the batch was sampled with these weights)."""
        cfg, stats = self.cfg, UpdateStats()
        if not check_onpolicy:
            stats.onpolicy_ratio_dev = math.nan  # not measured: the batch was sampled with older weights
        batch, window = len(trajectory), trajectory.log_probs.shape[1]
        if window == 0:
            raise ValueError("the rollout has no stochastic steps (sde_type 'ode' or noise_level 0): nothing to train")
        generator = torch.Generator().manual_seed(self._request_seed(self.step))
        self.mismatch.begin(self.policy, trajectory, micro_batch_size=cfg.micro_batch_size)
        optimizer_steps = 0
        self.policy.transformer.train()
        for _epoch in range(cfg.inner_epochs):
            micro_batches = torch.randperm(batch, generator=generator).split(cfg.micro_batch_size)
            accum = cfg.grad_accum or len(micro_batches)
            self.optimizer.zero_grad(set_to_none=True)
            for i, rows in enumerate(micro_batches):
                group_start = (i // accum) * accum
                group_end = min(group_start + accum, len(micro_batches))
                # Every row of an optimizer step weighs the same, 1 / (window x its rows on all ranks; shards are
                # equal): summed over ranks, the gradients are the one-process gradient of the whole batch.
                step_rows = sum(len(r) for r in micro_batches[group_start:group_end]) * self.parallel.world_size
                for k in range(window):
                    loss = self._micro_loss(trajectory, advantages, k, rows, stats,
                                            on_policy=check_onpolicy and optimizer_steps == 0)
                    (loss * (len(rows) / (window * step_rows))).backward()
                if i + 1 == group_end:
                    if check_onpolicy and optimizer_steps == 0:
                        self._check_onpolicy(stats)
                    self._optimizer_step(stats)
                    optimizer_steps += 1
        self.policy.transformer.eval()
        return stats

    def _micro_loss(self, trajectory: Trajectory, advantages: torch.Tensor, k: int, rows: torch.Tensor,
                    stats: UpdateStats, *, on_policy: bool) -> torch.Tensor:
        cfg = self.cfg
        new = replay_step(self.policy, trajectory, k, rows=rows)
        old_log_prob = trajectory.log_probs[rows, k].to(new.log_prob.device)
        if on_policy:
            self.mismatch.observe(new.log_prob, old_log_prob)
        # With trainer.mismatch.tis_cap: the trainer's pre-update log-prob, and TIS-weighted advantages.
        old_log_prob, weighted = self.mismatch.correct(rows, k, old_log_prob, advantages[rows].to(new.log_prob.device))
        policy_loss, ratio = clipped_ratio_loss(new.log_prob, old_log_prob, weighted, cfg.clip_range)
        if on_policy:  # checked against the tolerance before the first optimizer step (_check_onpolicy)
            deviation = float((ratio.detach() - 1.0).abs().max())
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
                f"loss {float(loss.detach())} (policy loss {float(policy_loss.detach())}, kl {float(kl.detach())}) at window step {k}"
            )
        s = loss_stats(new.log_prob, old_log_prob, ratio, cfg.clip_range)
        stats.losses.append(float(loss.detach()))
        stats.kls.append(float(kl.detach()))
        stats.approx_kls.append(s.approx_kl)
        stats.clip_fracs.append(s.clip_frac)
        stats.ratios.append(ratio.detach().cpu())
        return loss

    def _check_onpolicy(self, stats: UpdateStats) -> None:
        """Every rank's first replay must give ratio 1 on its rows; the ranks exchange their deviations, so a
        mismatch on any rank stops all of them before an optimizer step (nothing changes, nothing is published)."""
        cfg, world = self.cfg, self.parallel.world_size
        stats.onpolicy_ratio_dev_by_rank = by_rank = self.parallel.all_gather(stats.onpolicy_ratio_dev)
        stats.onpolicy_ratio_dev = deviation = max(by_rank)
        if deviation > cfg.onpolicy_tolerance:
            ranks = [r for r, d in enumerate(by_rank) if d > cfg.onpolicy_tolerance]
            where = f" on rank(s) {ranks} of {world}" if world > 1 else ""
            raise OnPolicyMismatchError(
                f"step {self.step}: replaying the rollout of version {self.version} before any update gives "
                f"|ratio - 1| = {deviation:.3g}{where} > trainer.onpolicy_tolerance {cfg.onpolicy_tolerance}; the replicas' "
                "weights, sampling settings or precision differ from the trainer's"
            )

    def _optimizer_step(self, stats: UpdateStats) -> None:
        self.parallel.reduce_gradients(self.model.parameters())
        grad_norm = scalar(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip_norm))
        if not math.isfinite(grad_norm):
            raise self._diverged(f"gradient norm {grad_norm}")
        stats.grad_norms.append(grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.step(self.model.parameters())

    def _diverged(self, what: str) -> TrainingDivergedError:
        last = self.metrics.rows[-1] if self.metrics.rows else None
        finite = (
            f"last finite values (step {int(last['step'])}): loss {last['loss']:.6g}, reward_mean {last['reward_mean']:.6g}, "
            f"ratio_max {last['ratio_max']:.6g}, policy_version {int(last['policy_version'])}"
            if last else "no finite step before it"
        )
        return TrainingDivergedError(
            f"non-finite {what} at step {self.step}; stopped before the optimizer step, the checkpoint is left as it "
            f"was; {finite}"
        )

    # -- weights ----------------------------------------------------------------------------

    def publish(self) -> int:
        """Publish the trainer's weights as a new version; returns it. Versions are never reused, so a
        replica that cached a version number always holds those exact weights. Every data-parallel rank
        calls it (fsdp gathers each tensor's shards); rank 0 publishes and tells the others the number."""
        state = self.parallel.full_tensors(self.model.publishable_state())
        return self.parallel.broadcast(self._publish_state(state) if self.parallel.is_leader else None)

    def _publish_state(self, state: dict[str, torch.Tensor]) -> int:
        version = self.store.latest_version() + 1
        self.store.publish(version, state, kind=self.model.kind, lora=self.model.spec)
        if self.cfg.prefetch and self.replica_handle is not None:
            self.replica_handle.prefetch_version.remote(version).result()
        return version

    def save_checkpoint(self) -> Path | None:
        """Every rank calls it (fsdp gathers whole tensors, so any run can resume it); rank 0 writes."""
        trainable = self.parallel.full_tensors(self.model.trainable_state())
        optimizer = self.parallel.full_optimizer_state(self.optimizer)
        if not self.parallel.is_leader:
            return None
        return save_checkpoint(
            self.out / "checkpoint", step=self.step, policy_version=self.version,
            trainable=trainable, optimizer=optimizer,
            ema=None if self.ema is None else self.ema.state_dict(),
            extra={"app_name": self.config.app_name, "kind": self.model.kind},
        )

    def _resume(self, directory: Path) -> None:
        state = load_checkpoint(directory)
        self.model.load_trainable_state(state.trainable)
        self.optimizer.load_state_dict(state.optimizer)
        if self.ema is not None and state.ema is not None:
            self.ema.load_state_dict(state.ema)
        self.step, self.version = state.step, state.policy_version
        if self.version > 0:
            # The replicas serve the store's tensors for this version; they must equal ours.
            stored = self.store.load(self.version).tensors
            mine = self.model.publishable_state()
            if set(stored) != set(mine) or any(not torch.equal(stored[k], mine[k]) for k in mine):
                raise PolicyVersionError(
                    f"checkpoint {directory} is at policy version {self.version}, but {self.store.where} holds other "
                    "weights under that version"
                )

    # -- evaluation and outputs ---------------------------------------------------------------

    def evaluate(self) -> dict[str, Any]:
        """Fixed-seed ODE samples after `self.step` updates: eval.csv rows and grids. With an EMA, its
        weights are published as a version of their own and evaluated; training stays on `self.version`."""
        if self.evaluator is None:
            raise RuntimeError("evaluations are off (trainer.eval_every = 0)")
        version, weights = self.version, "policy"
        if self.ema is not None and self.step > 0:
            with averaged_weights(self.ema, self.model.parameters()):  # rank 0 only: no collective here
                version, weights = self._publish_state(self.model.publishable_state()), "ema"
        return self.evaluator.evaluate(self.step, version, weights=weights, train_minutes=sum(self.step_seconds) / 60,
                                       images_sampled=self.images_sampled)

    def finish(self) -> None:
        from safetensors.torch import save_file

        self.pipeline.close()
        final = self.parallel.full_tensors(self.model.publishable_state())
        if not self.parallel.is_leader:
            return
        save_file(final, self.out / f"{self.model.kind}_final.safetensors")
        if self.metrics.rows:
            plot_reward_curve(self.metrics.rows, self.out / "reward_curve.png")
        if self.evaluator is not None:
            self.evaluator.finish()

    def summary(self) -> str:
        rows = self.metrics.rows
        if not rows:
            return "no steps"
        per_step = statistics.mean(self.step_seconds) if self.step_seconds else math.nan
        evaluation = self.evaluator.summary() if self.evaluator is not None else ""
        rewards = [r["reward_mean"] for r in rows]
        if len(rewards) >= 4:
            first, last = first_and_last(rewards)
            change = (f"reward mean of the first {len(first)} steps {statistics.mean(first):.5f}, of the last "
                      f"{len(last)} {statistics.mean(last):.5f} (Welch t {welch_t(first, last):+.1f} against the "
                      "step-to-step noise)")
        else:
            change = f"reward mean {statistics.mean(rewards):.5f}"
        return (
            (f"{evaluation}\n" if evaluation else "")
            + f"steps {len(rows)} | {change} | {per_step:.1f} s/step | final policy version {self.version} | "
            f"outputs in {self.out}"
        )

    # -- helpers ------------------------------------------------------------------------------

    def _prompts(self, step: int) -> list[str]:
        prompts, n = self.prompts, self.cfg.prompts_per_step
        start = (step * n) % len(prompts)
        return [prompts[(start + i) % len(prompts)] for i in range(n)]

    def _request_seed(self, step: int) -> int:
        return (self.cfg.seed * 1_000_003 + step) % (2**63)

    def _row(self, step: int, batch: TrajectoryBatch, advantages: torch.Tensor, stats: UpdateStats,
             sample_s: float, train_s: float, weight_sync_s: float, step_s: float) -> dict[str, float]:
        ratios = torch.cat(stats.ratios)
        total = batch.rewards[TOTAL_KEY]
        n = len(batch)
        row = {
            "step": step,
            "policy_version": batch.policy_version,
            "reward_mean": float(total.mean()),
            "reward_std": float(total.std(unbiased=False)),
            "advantage_mean": float(advantages.mean()),
            "advantage_std": float(advantages.std(unbiased=False)),
            "ratio_mean": float(ratios.mean()),
            "ratio_min": float(ratios.min()),
            "ratio_max": float(ratios.max()),
            "onpolicy_ratio_dev": stats.onpolicy_ratio_dev,
            "clip_frac": statistics.mean(stats.clip_fracs),
            "approx_kl": statistics.mean(stats.approx_kls),
            "kl": statistics.mean(stats.kls),
            "loss": statistics.mean(stats.losses),
            "grad_norm": statistics.mean(stats.grad_norms),
            "tied_group_fraction": float(batch.metrics.get("tied_group_fraction", math.nan)),
            "sample_images_per_s": n / sample_s,
            "train_images_per_s": n * self.cfg.inner_epochs / train_s,
            "weight_sync_s": weight_sync_s,
            "step_seconds": step_s,
            "eval_reward_mean": math.nan,
        }
        for key, value in batch.rewards.items():
            if key != TOTAL_KEY:
                row[f"reward_{key}_mean"] = float(value.mean())
        return row
