"""TokenizerIngress: the app's entry (HTTP and handle), a thin shell over the planner and the
RolloutCoordinator (serve_app/serving): it gives the coordinator handle calls - a chunk sampled on some
replica (re-run where its replica died), scored and collected by the aggregator. A chunk's images and
transitions stay references here: only its header is read, and the HTTP answer fetches what it encodes.
Its HTTP API (serve_app.serving.http_api) is built over this instance: the routes call the methods a handle
caller calls."""

from __future__ import annotations

import asyncio
import logging
import time

from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayActorError
from ray.serve import metrics
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle

from serve_app.config import RolloutConfig
from serve_app.errors import InvalidRequestError, ReplicaUnavailableError
from serve_app.serving.options import check_running_options
from serve_app.api import PublishedVersion, RolloutRequest, VersionInfo, VersionList
from serve_app.schemas import BatchLayout, ChunkHeader, GroupScores, RolloutChunk, SampledChunk, TrajectoryBatch
from serve_app.serving.coordinator import RolloutCoordinator, Scoring
from serve_app.serving.http_api import api_token, build_http_api
from serve_app.serving.ingress import RolloutPlanner
from serve_app.serving.uploads import WeightUploads
from serve_app.weights import LoraSpec, WeightKind, open_weight_store
from serve_app.weights.layout import Layout

logger = logging.getLogger("ray.serve")


def _running_in_a_replica() -> bool:
    """Whether this runs in a Serve replica of a Ray cluster (not in Serve's local testing mode)."""
    try:
        serve.get_replica_context()
    except RayServeException:
        return False
    return True


@serve.ingress()  # the FastAPI app is built per replica, over this instance (__serve_build_asgi_app__)
class TokenizerIngress:
    def __init__(self, replica: DeploymentHandle, aggregator: DeploymentHandle, config: RolloutConfig) -> None:
        from serve_app.policies import load_text_processor, model_dir

        check_running_options(config, "TokenizerIngress")
        self.config = config
        self.text_processor = load_text_processor(model_dir(config.model), family=config.model.family)
        self._planner: RolloutPlanner | None = None
        self._coordinator: RolloutCoordinator | None = None
        self._on_a_cluster = _running_in_a_replica()
        self.replica = replica
        self.aggregator = aggregator
        self.latency = metrics.Histogram(
            "flowgrpo_rollout_latency_seconds",
            description="Wall time of a rollout request, tokenization to advantages.",
            boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120],
        )
        self.requests = metrics.Counter(
            "flowgrpo_rollout_requests", description="Rollout requests by outcome.", tag_keys=("outcome",)
        )
        self.chunk_reruns = metrics.Counter(
            "flowgrpo_chunk_reruns", description="Chunks run again because their replica died."
        )
        self.api_token = api_token(config.ingress)  # read once: a token the deploy names must exist now
        self.uploads = WeightUploads(open_weight_store(config), self._weight_layout)

    def __serve_build_asgi_app__(self):
        return build_http_api(self, token=self.api_token, max_upload_bytes=self.config.weights.max_upload_bytes)

    async def planner(self) -> RolloutPlanner:
        """The planner, built on first use with the model geometry a replica reports (the ingress
        loads no weights)."""
        if self._planner is None:
            # A replica that dies while answering costs a retry on another, as a chunk does.
            geometry = await self._on_a_replica(lambda: self.replica.geometry.remote(), "reporting its geometry")
            self._planner = RolloutPlanner(
                self.text_processor, self.config.ingress, self.config.sampling, geometry,
                max_work=self.config.model.max_request_work, store=open_weight_store(self.config),
            )
        return self._planner

    async def coordinator(self) -> RolloutCoordinator:
        """The coordinator, built on first use with the scoring the aggregator's rewards need."""
        if self._coordinator is None:
            kinds = await self.aggregator.scoring.remote()
            scoring = Scoring(kinds["per_sample"], kinds["groupwise"], self.config.aggregator.score_while_sampling,
                              kinds["input_images"])
            self._coordinator = RolloutCoordinator(self.sample, self.aggregator.score.remote, self.collect, scoring)
        return self._coordinator

    async def collect(self, prompts: list[str], group_size: int, scores: list[GroupScores],
                      headers: list[ChunkHeader]) -> BatchLayout:
        return await self.aggregator.collect.remote(prompts, group_size, scores, headers)

    async def sample(self, chunk: RolloutChunk) -> SampledChunk:
        """One chunk on some replica. A replica that dies while holding it costs a re-run on another
        (or the restarted) one, not the request: the chunk's seeds make the re-run exactly the
        trajectory the undisturbed run returns."""
        return await self._on_a_replica(lambda: self._sample_once(chunk), "running a chunk",
                                        on_rerun=self.chunk_reruns.inc)

    async def _on_a_replica(self, call, what: str, on_rerun=None):
        """`call()` again (up to ingress.chunk_retry.attempts) while the replica it reached dies; then a
        ReplicaUnavailableError (HTTP 503) saying what the replica was doing."""
        policy = self.config.ingress.chunk_retry

        def rerun(exc: BaseException, failed: int) -> None:
            logger.warning("replica %s died (attempt %d of %d): %s", what, failed, policy.attempts, exc)
            if on_rerun is not None:
                on_rerun()

        try:
            return await policy.call_async(call, retryable=lambda exc: isinstance(exc, RayActorError), on_retry=rerun)
        except RayActorError:
            raise ReplicaUnavailableError(
                f"the replica {what} died {policy.attempts} times in a row (ingress.chunk_retry.attempts = "
                f"{policy.attempts}); retry the request"
            ) from None

    async def _sample_once(self, chunk: RolloutChunk) -> SampledChunk:
        """The replica yields the chunk's header, images and transitions as three objects, which this
        process owns (so they outlive the replica) without fetching the last two."""
        parts = self.replica.options(stream=True, _by_reference=True).generate.remote(chunk)
        if not self._on_a_cluster:  # Serve's local testing mode: one process, the values themselves
            header, images, transitions = [part async for part in parts]
            return SampledChunk(header, images, transitions)
        # Iterated in a thread: the synchronous iteration waits for each object without fetching it, where
        # Ray 2.60's async iteration fetches an object that is not ready yet into this process.
        refs = await asyncio.to_thread(list, await parts._to_object_ref_gen())
        if len(refs) != 3:
            # The stream ended early: its last object holds the failure (the chunk's own error, or the
            # replica's death), which awaiting it raises.
            for ref in refs:
                await ref
            raise RuntimeError(f"the replica yielded {len(refs)} of a chunk's 3 parts")
        header, images, transitions = refs
        return SampledChunk(await header, images, transitions)

    async def rollout(self, request: RolloutRequest | dict) -> TrajectoryBatch:
        """The trainer's entry: a TrajectoryBatch whose tensors the trainer fetches. Raises
        InvalidRequestError & co."""
        started = time.perf_counter()
        outcome = "error"
        try:
            if isinstance(request, dict):
                try:
                    request = RolloutRequest.model_validate(request)
                except ValidationError as exc:
                    raise InvalidRequestError.from_validation(exc) from None
            # Tokenizing is CPU work; a thread keeps the event loop free (the processor locks the tokenizer).
            plan = await asyncio.to_thread((await self.planner()).plan, request)
            batch = await (await self.coordinator()).run(plan.chunks, plan.prompts, plan.group_size,
                                                         request_id=plan.request_id, input_images=plan.input_images)
            outcome = "ok"
            return batch
        finally:
            self.requests.inc(tags={"outcome": outcome})
            self.latency.observe(time.perf_counter() - started)

    async def publish_weights(self, body: bytearray) -> PublishedVersion:
        """A weight version from outside (POST /v1/weights; serve_app.serving.uploads), stored as the next one."""
        return await self.uploads.publish(body)

    async def weight_versions(self) -> VersionList:
        return await asyncio.to_thread(self.uploads.versions)

    async def weight_version(self, version: int) -> VersionInfo:
        return await asyncio.to_thread(self.uploads.describe, version)

    async def _weight_layout(self, kind: WeightKind, lora: LoraSpec | None) -> Layout:
        return await self._on_a_replica(lambda: self.replica.weight_layout.remote(kind, lora), "reporting its weights")
