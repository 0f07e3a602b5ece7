"""The reference FlowGRPO trainer's loop: what to sample, when to publish, how stale a batch may be.

One training step, top to bottom:

    1. rollout  - the next batch from the RolloutPipeline: sampled at version v' <= v, stamped with
                  v' and the content hash of the weights the replicas checked they held
    2. prefill  - with trainer.max_staleness k > 0, k more rollouts are sent (pinned to v) to run
                  while this update does
    3. update   - serve_app.trainer.update: a sample of the batch replayed with the weights of the
                  version that sampled it must give its log-probs (the mismatch check, at any
                  staleness); replay, clipped loss, AdamW; at staleness 0 the first replay must
                  give ratio 1
    4. publish  - store.publish_next(adapter tensors) -> v + 1 (the weight store, or POST /v1/weights over
                  HTTP); new rollouts are pinned to it, and the trainer keeps the tensors for the check of the
                  batches they sample
    5. log      - one metrics.csv row (serve_app.trainer.outputs); grids, evaluations and checkpoints
                  every few steps

On N data-parallel ranks (serve_app.trainer.parallel) the same code runs on each: rank 0 does 1, 2, 4
and 5 and sends every rank its shard of whole groups for 3; one process is world size 1.

A run resumed from its checkpoint (serve_app.trainer.checkpoint) is the run it would have been: the
checkpoint holds the rollouts in flight and the versions they were pinned to, and a rollout's prompts and
seed follow from its index, so the resumed run sends the same pinned, seeded requests and replays them
with the same weights.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from serve_app.errors import PolicyVersionError
from serve_app.policies.base import DiffusionPolicy
from serve_app.config.sampling import SamplingParams
from serve_app.schemas import ImagePrompt, TrajectoryBatch, split_image_prompts
from serve_app.trainer.algorithms import rollout_sampling
from serve_app.trainer.checkpoint import (CheckpointState, generator_states, load_checkpoint, restore_generators,
                                          save_checkpoint)
from serve_app.trainer.config import TrainerRunConfig
from serve_app.trainer.ema import averaged_weights
from serve_app.trainer.evaluation import RunEvaluator
from serve_app.trainer.faults import check_crash_env, crash_point
from serve_app.trainer.outputs import MetricsLog, metrics_row, plot_reward_curve, run_summary, save_image_grid
from serve_app.trainer.parallel import DataParallel
from serve_app.trainer.pipeline import Delivered, RolloutPipeline
from serve_app.trainer.telemetry import TrainerTelemetry
from serve_app.trainer.update import OnPolicyMismatchError, PolicyUpdate, TrainingDivergedError, UpdateStats
from serve_app.weights import LoraSpec, WeightKind, check_weights_hash, content_hash, open_weight_store

__all__ = ["FlowGRPOTrainer", "OnPolicyMismatchError", "RolloutSource", "TrainingDivergedError", "WeightPublisher",
           "load_trainer_policy"]


class RolloutSource(Protocol):
    """What the trainer samples from (a RolloutClient, or an HttpRolloutClient); `images` is passed only for
    prompts with input images."""

    def rollout(self, prompts: list[str], group_size: int, sampling: Any = None, policy_version: int | None = None,
                seed: int | None = None, *, timeout_s: float | None = None, fetch: bool = True,
                return_images: bool = False, images: list[list[torch.Tensor]] | None = None) -> TrajectoryBatch: ...


class WeightPublisher(Protocol):
    """Where the trainer publishes versions and reads what was published (a VersionStore, or the service's
    /v1/weights over HTTP: serve_app.trainer.connect.HttpPublisher)."""

    def publish_next(self, tensors: dict[str, torch.Tensor], *, kind: WeightKind,
                     lora: LoraSpec | None = None) -> tuple[int, str]: ...

    def published_hash(self, version: int) -> str: ...


def load_trainer_policy(config: TrainerRunConfig) -> DiffusionPolicy:
    """The same checkpoint the app's replicas load (config.model), on this process's device."""
    from serve_app.policies import load_configured_policy

    return load_configured_policy(config.model)


class FlowGRPOTrainer:
    """Trains a LoRA (or the whole transformer) against a deployed rollout app.

    Args:
        config: the run's config (the app must run the same model and weights_dir).
        client: a RolloutClient (or anything with its `rollout`).
        out_dir: outputs/<run>.
        policy: an already loaded policy (tests); default loads config.model.
        resume: a checkpoint directory to continue from.
        replica_handle: optional DiffusionReplica handle to push new versions ahead (trainer.prefetch).
        parallel: this process's rank in a data-parallel group (serve_app.trainer.parallel); default one
            process. Ranks other than 0 get no client: they replay the shards rank 0 sends, and write nothing.
        publisher: where versions are published (`self.store`); default the config's weight store, the app's.
    """

    def __init__(self, config: TrainerRunConfig, client: RolloutSource | None, out_dir: str | Path, *,
                 policy: DiffusionPolicy | None = None, resume: str | Path | None = None,
                 replica_handle: Any | None = None, progress: bool = True,
                 parallel: DataParallel | None = None, publisher: WeightPublisher | None = None) -> None:
        check_crash_env()
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
        self.parallel = parallel if parallel is not None else DataParallel()
        leader = self.parallel.is_leader
        self.metrics = MetricsLog(self.out / "metrics.csv", append=resume is not None and leader)
        self.update = PolicyUpdate(self.cfg, self.policy, self.parallel, history=self.metrics.rows)
        self.model = self.update.model
        self.store: WeightPublisher = publisher if publisher is not None else open_weight_store(config)
        self.sampling: SamplingParams = config.sampling
        self.step = 0  # steps completed
        self.resumed_from_step: int | None = None  # the checkpoint's steps, when resumed
        self.version = 0  # the version the trainer's weights equal (0 = base; a fresh adapter is a no-op)
        self.images_sampled = 0  # rollout images so far (evaluations not counted)
        self.train_seconds = 0.0  # wall time of the steps so far (evaluations included)
        self.total_steps = self.cfg.steps
        self.prompts = self.cfg.training_prompts()
        if self.cfg.shuffle_prompts:
            random.Random(self.cfg.seed).shuffle(self.prompts)
        # The versions updates published, in order (EMA versions are evaluated, never trained from):
        # a batch's staleness is the number of updates since its version.
        self.policy_versions = [self.version]
        self.dropped_batches = 0
        self._unrecorded: int | None = None  # after a resume: the version a killed run may have published unrecorded
        in_flight: tuple[tuple[int, int], ...] = ()
        if resume is not None:
            in_flight = self._resume(Path(resume))
        if self.version not in self.model.kept_versions:  # a resumed soft-updated sampling policy is kept already
            self.model.keep_version(self.version)  # the weights a batch of that version is checked against
        self.pipeline = RolloutPipeline(self._request_rollout, max_staleness=self.cfg.max_staleness,
                                        first_index=self.step, resent=in_flight)
        self.telemetry = TrainerTelemetry.if_on_a_cluster() if leader else None
        self.evaluator = (RunEvaluator(config, client, self.out, append=resume is not None)
                          if self.cfg.eval_every and leader else None)
        if resume is not None:
            self.metrics.truncate_after(self.step - 1)
            self.images_sampled = len(self.metrics.rows) * self.cfg.prompts_per_step * self.cfg.group_size
            self.train_seconds = sum(r["step_seconds"] for r in self.metrics.rows)
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
                # DiffusionNFT has no ratio: its loss instead.
                shown = ({"loss": f"{row['loss']:.4f}"} if math.isnan(row["ratio_max"])
                         else {"ratio": f"{row['ratio_max']:.4f}"})
                bar.set_postfix(reward=f"{row['reward_mean']:.4f}", **shown, v=self.version)
            last = self.step == total
            if self.cfg.checkpoint_every and (self.step % self.cfg.checkpoint_every == 0) or last:
                self.save_checkpoint()
        bar.close()
        self.finish()
        return self.metrics.rows

    def train_step(self) -> dict[str, float]:
        """One step; returns its metrics row (an empty one on data-parallel ranks other than 0). Data-parallel
        ranks (self.parallel; one process is world size 1) take part in each phase: rank 0 collects, publishes
        and logs; every rank replays its shard."""
        step, started = self.step, time.perf_counter()
        # 1. Collect: the next rollout, sampled at most max_staleness updates ago; the next ones are sent now, to
        # run while this update does (none at staleness 0).
        delivered, staleness = self._collect(step)
        # 2. Replay, loss, optimizer step: this rank's shard of whole groups (one process: the whole batch). The
        # stored log-probs are the behaviour policy's: at staleness > 0 the first ratio is not 1, but a replay with
        # the behaviour version's kept weights must give them (the mismatch check).
        train_started = time.perf_counter()
        stats = self._update(delivered, staleness, step)
        train_s = time.perf_counter() - train_started
        # 3. Publish the new weights; rollouts sent from now on are pinned to them.
        sync_started = time.perf_counter()
        self._publish_version(step)
        weight_sync_s = time.perf_counter() - sync_started
        self.step += 1
        # 4. Log (rank 0).
        return self._log(step, delivered, staleness, stats, train_s=train_s, weight_sync_s=weight_sync_s,
                         step_s=time.perf_counter() - started)

    def _collect(self, step: int) -> tuple[Delivered | None, int]:
        if not self.parallel.is_leader:
            return None, 0
        self.pipeline.start(self.version)
        crash_point("rollout", step)
        delivered, staleness = self._next_rollout()
        self.pipeline.prefill(self.version)
        return delivered, staleness

    def _update(self, delivered: Delivered | None, staleness: int, step: int) -> UpdateStats:
        shard = self.parallel.scatter(None if delivered is None else delivered.batch, check_onpolicy=staleness == 0)
        stats = self.update.run(shard.trajectory, shard.advantages, check_onpolicy=shard.check_onpolicy,
                                seed=self._request_seed(step), step=step)
        return UpdateStats.merged(self.parallel.all_gather(stats))

    def _publish_version(self, step: int) -> None:
        # DiffusionNFT's soft-updated sampling policy is published in place of the trained weights (held for the
        # publish only: training goes on from the trained ones).
        sampling = self.update.next_sampling_state(step, self.version)
        with self.model.holding(sampling) if sampling is not None else contextlib.nullcontext():
            self.version = self.publish()
            self.policy_versions.append(self.version)
            self.model.keep_version(self.version)  # for the mismatch check of the batches it samples
        crash_point("publish", step)

    def _log(self, step: int, delivered: Delivered | None, staleness: int, stats: UpdateStats, *, train_s: float,
             weight_sync_s: float, step_s: float) -> dict[str, float]:
        cfg = self.cfg
        if delivered is None:
            self.update.mismatch.end()  # this rank's share is not logged
            return {}
        batch = delivered.batch
        row = metrics_row(step, batch, stats, inner_epochs=cfg.inner_epochs, sample_s=delivered.sampling_seconds,
                          train_s=train_s, weight_sync_s=weight_sync_s, step_s=step_s)
        row.update(self.update.mismatch.end())
        row.update(stats.checks)
        row.update(staleness=staleness, dropped_batches=self.dropped_batches,
                   trainer_idle_s=delivered.trainer_idle_seconds, rollout_wait_s=delivered.rollout_wait_seconds)
        if self.parallel.world_size > 1:  # every rank's own first-replay check
            row.update({f"onpolicy_ratio_dev_rank{r}": d for r, d in enumerate(stats.onpolicy_ratio_dev_by_rank)})
        if self.telemetry is not None:
            self.telemetry.record(row, trainer_version=self.version)
        if cfg.image_every and step % cfg.image_every == 0:
            save_image_grid(batch.images, self.out / f"train_step{step:05d}.png", columns=cfg.group_size)
        self.images_sampled += len(batch)
        self.train_seconds += row["step_seconds"]
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
            check_weights_hash(batch.header, self.store)
            staleness = len(self.policy_versions) - 1 - self.policy_versions.index(batch.policy_version)
            if staleness <= self.cfg.max_staleness:
                return delivered, staleness
            self.dropped_batches += 1

    def _request_rollout(self, index: int, version: int) -> TrajectoryBatch:
        """Rollout `index` (its prompts and seed) pinned to `version`; runs on a pipeline thread."""
        texts, images = split_image_prompts(self._prompts(index))
        sampling = rollout_sampling(self.cfg, self.sampling, index)  # the algorithm's settings of this rollout
        return self.client.rollout(
            texts, self.cfg.group_size, sampling=sampling, policy_version=version, seed=self._request_seed(index),
            timeout_s=self.cfg.rollout_timeout_s, return_images=bool(self.cfg.image_every),
            **({} if images is None else {"images": images}),
        )

    def _prompts(self, step: int) -> list[str] | list[ImagePrompt]:
        prompts, n = self.prompts, self.cfg.prompts_per_step
        start = (step * n) % len(prompts)
        return [prompts[(start + i) % len(prompts)] for i in range(n)]

    def _request_seed(self, step: int) -> int:
        return (self.cfg.seed * 1_000_003 + step) % (2**63)

    # -- weights ----------------------------------------------------------------------------

    def publish(self) -> int:
        """Publish the trainer's weights as a new version; returns it. Versions are never reused, so a
        replica that cached a version number always holds those exact weights. Every data-parallel rank
        calls it (fsdp gathers each tensor's shards); rank 0 publishes and tells the others the number."""
        state = self.parallel.full_tensors(self.model.publishable_state())
        if not self.parallel.is_leader:
            return self.parallel.broadcast(None)
        return self.parallel.broadcast(self._published_unrecorded(state) or self._publish_state(state))

    def _published_unrecorded(self, state: dict[str, torch.Tensor]) -> int | None:
        """On the first publish after a resume: the version after the checkpoint's, if it holds exactly `state`.
        A run killed after publishing and before checkpointing left it; the same weights are not stored twice,
        and other weights never take its number (they are published under the next one)."""
        version, self._unrecorded = self._unrecorded, None
        if version is None:
            return None
        try:
            published = self.store.published_hash(version)
        except PolicyVersionError:  # not published
            return None
        return version if published == content_hash(state, self.model.spec) else None

    def _publish_state(self, state: dict[str, torch.Tensor]) -> int:
        version, _ = self.store.publish_next(state, kind=self.model.kind, lora=self.model.spec)
        if self.cfg.prefetch and self.replica_handle is not None:
            self.replica_handle.prefetch_version.remote(version).result()
        return version

    def save_checkpoint(self) -> Path | None:
        """Every rank calls it (fsdp gathers whole tensors, so any run can resume it); rank 0 writes."""
        trainable = self.parallel.full_tensors(self.model.trainable_state())
        optimizer = self.parallel.full_optimizer_state(self.update.optimizer)
        kept = {}
        for version in self.model.kept_versions:  # the versions rollouts in flight may come from
            if version != self.version or self.cfg.averages_sampling:  # (the current one: unless trained on)
                with self.model.at_version(version):
                    kept[version] = self.parallel.full_tensors(self.model.trainable_state())
        if not self.parallel.is_leader:
            return None
        ema = self.update.ema
        in_flight = self.pipeline.in_flight()
        oldest = min([version for _, version in in_flight], default=self.version)
        state = CheckpointState(
            step=self.step, policy_version=self.version, trainable=trainable, optimizer=optimizer,
            ema=None if ema is None else ema.state_dict(), kept=kept, in_flight=tuple(in_flight),
            policy_versions=tuple(self.policy_versions[self.policy_versions.index(oldest):]),
            dropped_batches=self.dropped_batches, rng=generator_states(),
        )
        return save_checkpoint(self.out / "checkpoint", state,
                               extra={"app_name": self.config.app_name, "kind": self.model.kind})

    def _resume(self, directory: Path) -> tuple[tuple[int, int], ...]:
        """Loads the checkpoint; returns the rollouts it recorded in flight, to be sent again as they were."""
        state = load_checkpoint(directory)
        for version, tensors in state.kept.items():  # oldest first, as they were kept
            self.model.load_trainable_state(tensors)
            self.model.keep_version(version)
        self.model.load_trainable_state(state.trainable)
        self.update.optimizer.load_state_dict(state.optimizer)
        if self.update.ema is not None and state.ema is not None:
            self.update.ema.load_state_dict(state.ema)
        self.step, self.version = state.step, state.policy_version
        self.resumed_from_step = state.step
        self.policy_versions = list(state.policy_versions) or [self.version]
        self.dropped_batches = state.dropped_batches
        self._unrecorded = self.version + 1
        if state.rng is not None:
            restore_generators(state.rng)
        if self.version > 0:
            # The replicas serve what was published under this version; it must be ours (by content hash).
            published = self.store.published_hash(self.version)
            held = (self.model.at_version(self.version) if self.version in self.model.kept_versions
                    else contextlib.nullcontext())  # a soft-updated sampling policy's own tensors
            with held:
                mine = content_hash(self.model.publishable_state(), self.model.spec)
            if mine != published:
                raise PolicyVersionError(
                    f"checkpoint {directory} is at policy version {self.version}, but the app holds other weights "
                    f"under that version (published as {published[:12]})"
                )
        return state.in_flight

    # -- evaluation and outputs ---------------------------------------------------------------

    def evaluate(self) -> dict[str, Any]:
        """Fixed-seed ODE samples after `self.step` updates: eval.csv rows and grids. With an EMA, its
        weights are published as a version of their own and evaluated; training stays on `self.version`."""
        if self.evaluator is None:
            raise RuntimeError("evaluations are off (trainer.eval_every = 0)")
        version, weights = self.version, "policy"
        if self.update.ema is not None and self.step > 0:
            with averaged_weights(self.update.ema, self.model.parameters()):  # rank 0 only: no collective here
                version, weights = self._publish_state(self.model.publishable_state()), "ema"
        return self.evaluator.evaluate(self.step, version, weights=weights, train_minutes=self.train_seconds / 60,
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
        evaluation = self.evaluator.summary() if self.evaluator is not None else ""
        return run_summary(self.metrics.rows, evaluation=evaluation, final_version=self.version, out=self.out)
