"""This process's place in a data-parallel training group, and the few collectives the trainer needs.

One step on N ranks (one process is world size 1 of the same code: every collective here is then a no-op):

    rank 0  takes the next rollout from the app (only rank 0 holds a client) and scatters it: rank r gets
            the r-th block of whole groups (trainer.prompts_per_step must divide by the workers, so shards
            are equal and every rank runs the same micro-batches in lockstep)
    all     replay their rows; each row's loss is scaled by 1 / (window x rows of the optimizer step on all
            ranks), so the SUM of the ranks' gradients is the one-process gradient of the whole batch
            (ddp: one flat all-reduce before each optimizer step; fsdp: FSDP2's reduce-scatter with divide
            factor 1). Before each update the ranks exchange the log ratios of their mismatch check (a
            group of their shard replayed with the behaviour version's weights; with action "stop" a
            mismatch on any rank stops all), and before the first optimizer step of an on-policy batch
            their |ratio - 1|: a mismatch on any rank stops every rank before it steps or publishes.
    rank 0  publishes v + 1 (fsdp: every rank first gathers its parameter shards) and writes the outputs;
            every rank learns the version number.

Strategies (trainer.distributed.strategy): `ddp` replicates the transformer on every rank; `fsdp` shards
its parameters with torch's FSDP2 (`fully_shard` on each transformer block, then the root) for a
transformer that does not fit one device: parameters, gradients and optimizer state live in 1/N per rank
between forwards. Each rank still loads the whole checkpoint before sharding it (loading straight into
shards is not implemented). Both strategies are tested on gloo (CPU); `use_gpu` selects nccl (not run here).
The workers are launched by serve_app.trainer.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from serve_app.schemas import Trajectory, TrajectoryBatch
    from serve_app.trainer.lora import TrainableTransformer

Strategy = Literal["ddp", "fsdp"]


@dataclass(frozen=True)
class Shard:
    """What one rank replays of a rollout.

    trajectory: this rank's rows (whole groups; the whole batch in one process).
    advantages: [n] float32, the same rows' advantages.
    check_onpolicy: the batch was sampled with the current weights (staleness 0): the first replay must give 1.
    """

    trajectory: Trajectory
    advantages: torch.Tensor
    check_onpolicy: bool


def shard_rows(batch_rows: int, group_size: int, world_size: int) -> list[torch.Tensor]:
    """Rank r's rows: the r-th of `world_size` equal blocks of whole groups, in batch order.

    Whole groups, so a rank ships each prompt's embedding once; equal blocks, so every rank runs the same
    micro-batches (FSDP's all-gathers are collectives every rank must join).

    Raises:
        ValueError: the groups do not split evenly over the ranks.
    """
    groups, rest = divmod(batch_rows, group_size)
    if rest or groups % world_size:
        raise ValueError(
            f"a rollout of {batch_rows} rows in groups of {group_size} does not split into {world_size} equal blocks "
            "of whole groups; make trainer.prompts_per_step a multiple of trainer.distributed.workers"
        )
    per_rank = batch_rows // world_size
    return [torch.arange(r * per_rank, (r + 1) * per_rank) for r in range(world_size)]


class DataParallel:
    """This process's place in the training group and the few collectives the trainer needs.

    Without an initialised torch.distributed group it is world size 1 and every method returns its input.
    """

    def __init__(self, strategy: Strategy = "ddp") -> None:
        self.strategy = strategy
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world_size > 1 else 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # -- setup ------------------------------------------------------------------------------

    def prepare(self, model: TrainableTransformer) -> None:
        """Before the optimizer is built: every rank starts from rank 0's trainable weights (as DDP's
        constructor does), and with fsdp the transformer's parameters are sharded."""
        if self.world_size == 1:
            return
        with torch.no_grad():
            for param in model.parameters():
                dist.broadcast(param.data, src=0)
        if self.strategy == "fsdp":
            from torch.distributed.fsdp import FSDPModule, fully_shard

            for transformer in model.experts.values():
                for child in transformer.children():
                    if isinstance(child, torch.nn.ModuleList):  # the transformer blocks: one all-gather unit each
                        for block in child:
                            fully_shard(block)
                fully_shard(transformer)
                for module in transformer.modules():
                    if isinstance(module, FSDPModule):
                        # Sum, not mean: each rank's loss is already scaled by the rows of all ranks. Plain SUM
                        # collectives, since a divide factor is otherwise applied with PREMUL_SUM, which gloo lacks.
                        module.set_gradient_divide_factor(1.0)
                        module.set_force_sum_reduction_for_comms(True)
            # fully_shard swapped every parameter for a DTensor one: the optimizer must see the new ones.
            model.named = model.trainable_parameters()

    # -- per step ---------------------------------------------------------------------------

    def scatter(self, batch: TrajectoryBatch | None, *, check_onpolicy: bool) -> Shard:
        """Rank 0 passes the rollout (the others None) and every rank gets its shard.

        scatter_object_list rather than Ray object refs: each rank receives only its own groups, over the
        process group the gradients use anyway, and the call doubles as the barrier at which the other
        ranks wait for rank 0's rollout.
        """
        if self.world_size == 1:
            assert batch is not None
            return Shard(batch.transitions, batch.advantages.float(), check_onpolicy)
        shards: list[Shard] | None = None
        if self.is_leader:
            assert batch is not None
            advantages = batch.advantages.float()
            shards = [Shard(batch.transitions.take(rows), advantages[rows].clone(), check_onpolicy)
                      for rows in shard_rows(len(batch), batch.group_size, self.world_size)]
        received: list[Any] = [None]
        dist.scatter_object_list(received, shards, src=0)
        return received[0]

    def reduce_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """ddp: sum the ranks' gradients in one flat all-reduce before the optimizer step. fsdp: nothing,
        its reduce-scatter summed them during backward.

        A flat all-reduce at the step instead of torch's DistributedDataParallel wrapper: the policy calls
        its transformer through diffusers' pipeline, which needs the module itself (config, dtype, adapters),
        and gradients are accumulated over micro-batches anyway, where DDP would only sync the last.
        """
        if self.world_size == 1 or self.strategy == "fsdp":
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for param, part in zip(parameters, flat.split([g.numel() for g in grads])):
            param.grad = part.view_as(param).clone()

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        if self.world_size == 1:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def full_tensors(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole tensors from fsdp's sharded DTensors; a collective, so every rank calls it."""
        from torch.distributed.tensor import DTensor

        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state_dict with whole tensors (what one process would save); every rank calls it."""
        state = optimizer.state_dict()
        if self.strategy != "fsdp" or self.world_size == 1:
            return state
        return {**state, "state": {i: self.full_tensors(s) for i, s in state["state"].items()}}


def scalar(value: Any) -> float:
    """A float from a tensor that may be an fsdp DTensor (a sharded gradient's norm)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.full_tensor()
    return float(value)
