"""The replica's logic: fuse concurrent chunks into batches, keep the weights at the pinned version,
run the sampler, split the result back per chunk."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serve_app.errors import PolicyVersionError
from serve_app.flowgrpo.sampler import encode_conditioning, rollout
from serve_app.policies.base import DiffusionPolicy
from serve_app.schemas import PromptEmbeds, RolloutChunk, Trajectory
from serve_app.weights import WeightStore, WeightVersion


@dataclass
class BatchStats:
    images: int
    seconds: float
    seconds_per_step: float
    policy_version: int


class PolicyVersions:
    """Moves a policy's transformer between weight versions (LoRA adapters or full state dicts)."""

    ADAPTER = "flowgrpo"

    def __init__(self, policy: DiffusionPolicy, store: WeightStore | None) -> None:
        self.policy = policy
        self.store = store
        self.current = 0
        self._base_state: dict[str, torch.Tensor] | None = None

    def resolve(self, requested: int | None) -> int:
        """None means the newest published version at the time the batch runs."""
        if requested is not None:
            return requested
        return self.store.latest_version() if self.store is not None else self.current

    def ensure(self, version: int) -> None:
        if version == self.current:
            return
        transformer = self.policy.transformer
        if version == 0:
            self._to_base(transformer)
        else:
            if self.store is None:
                raise PolicyVersionError(f"policy version {version} asked for, but this replica has no weight store")
            self._apply(transformer, self.store.load(version))
        self.current = version

    def _to_base(self, transformer: torch.nn.Module) -> None:
        if getattr(transformer, "peft_config", None):
            transformer.disable_adapters()
        if self._base_state is not None:
            transformer.load_state_dict(self._base_state)

    def _apply(self, transformer: torch.nn.Module, weights: WeightVersion) -> None:
        if weights.kind == "full":
            if self._base_state is None:  # keep the base to return to version 0
                self._base_state = {k: v.detach().clone() for k, v in transformer.state_dict().items()}
            transformer.load_state_dict(weights.tensors)
            return
        from peft import set_peft_model_state_dict

        assert weights.lora is not None
        if self.ADAPTER not in (getattr(transformer, "peft_config", None) or {}):
            transformer.add_adapter(weights.lora.peft_config(), adapter_name=self.ADAPTER)
        result = set_peft_model_state_dict(transformer, weights.tensors, adapter_name=self.ADAPTER)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"LoRA tensors of version {weights.version} do not fit: {result.unexpected_keys[:3]}")
        transformer.set_adapter(self.ADAPTER)
        transformer.enable_adapters()


class RolloutEngine:
    """Runs chunks on one policy; thread-safe (one batch at a time)."""

    def __init__(self, policy: DiffusionPolicy, store: WeightStore | None = None) -> None:
        self.policy = policy
        self.versions = PolicyVersions(policy, store)
        self._lock = threading.Lock()

    def generate(self, chunks: Sequence[RolloutChunk]) -> tuple[list[Trajectory], list[BatchStats]]:
        """One trajectory per chunk, in order. Chunks that can share a batch (same params, window and
        version) run as one forward batch; a chunk's result does not depend on its neighbours."""
        results: list[Trajectory | None] = [None] * len(chunks)
        stats = []
        with self._lock:
            for key, members in self._fusable_groups(chunks).items():
                version = key[0]
                self.versions.ensure(version)
                fused = [chunks[i] for i in members]
                for i, trajectory in zip(members, self._run(fused, version, stats)):
                    results[i] = trajectory
        return [t for t in results if t is not None], stats

    def prefetch(self, version: int) -> int:
        """Load `version` now, between batches; returns the version loaded."""
        with self._lock:
            self.versions.ensure(version)
            return self.versions.current

    def _fusable_groups(self, chunks: Sequence[RolloutChunk]) -> dict[tuple, list[int]]:
        groups: dict[tuple, list[int]] = {}
        for i, chunk in enumerate(chunks):
            version = self.versions.resolve(chunk.policy_version)
            key = (version, chunk.sampling.model_copy(update={"seed": None}), chunk.window_start)
            groups.setdefault(key, []).append(i)
        return groups

    def _run(self, chunks: list[RolloutChunk], version: int, stats: list[BatchStats]) -> list[Trajectory]:
        params = chunks[0].sampling
        started = time.perf_counter()
        # 1. Encode each chunk's distinct prompts once (rows offset per chunk), and the negative once.
        offsets = torch.tensor([0] + [len(c.prompts) for c in chunks[:-1]]).cumsum(0)
        embed_row = torch.cat([c.prompt_slot + off for c, off in zip(chunks, offsets.tolist())])
        conditioning = encode_conditioning(
            self.policy, [p for c in chunks for p in c.prompts], embed_row.to(self.policy.device),
            chunks[0].negative_prompt, params,
        )
        # 2. Sample the fused batch.
        fused = rollout(
            self.policy,
            conditioning,
            torch.cat([c.seeds for c in chunks]),
            params,
            window_start=chunks[0].window_start,
            prompt_index=torch.cat([c.prompt_index for c in chunks]),
            sample_index=torch.cat([c.sample_index for c in chunks]),
            policy_version=version,
        )
        seconds = time.perf_counter() - started
        stats.append(BatchStats(len(fused), seconds, seconds / params.num_steps, version))
        # 3. Split back: each chunk gets its own samples and only its prompts' embeddings.
        out, start = [], 0
        for chunk, off in zip(chunks, offsets.tolist()):
            rows = slice(start, start + len(chunk))
            prompt_rows = torch.arange(off, off + len(chunk.prompts))
            out.append(_slice(fused, rows, embeds_for_chunk=fused.prompt_embeds.select(prompt_rows), embed_row=chunk.prompt_slot))
            start += len(chunk)
        return out


def _slice(t: Trajectory, rows: slice, *, embeds_for_chunk: PromptEmbeds, embed_row: torch.Tensor) -> Trajectory:
    # clone(): a view would pickle its whole parent storage when sent to the aggregator.
    return Trajectory(
        latents=t.latents[rows].clone(),
        log_probs=t.log_probs[rows].clone(),
        sigmas=t.sigmas,
        step_indices=t.step_indices,
        images=t.images[rows].clone(),
        seeds=t.seeds[rows].clone(),
        prompt_embeds=embeds_for_chunk,
        embed_row=embed_row.clone(),
        negative_embeds=t.negative_embeds,
        sampling=t.sampling,
        prompt_index=t.prompt_index[rows].clone(),
        sample_index=t.sample_index[rows].clone(),
        policy_version=t.policy_version,
    )
