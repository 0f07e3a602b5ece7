"""TokenizerIngress: the app's entry (HTTP and handle), a thin shell over the planner and the
RolloutCoordinator (serve_app/serving): it gives the coordinator handle calls - a chunk sampled on some
replica (re-run where its replica died), scored and collected by the aggregator. A chunk's images and
transitions stay references here: only its header is read, and the HTTP answer fetches what it encodes."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayActorError
from ray.serve import metrics
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle

from serve_app.config import RolloutConfig
from serve_app.errors import InvalidRequestError, ReplicaUnavailableError, http_error
from serve_app.serving.options import check_running_options
from serve_app.schemas import (
    BatchLayout,
    ChunkHeader,
    ErrorResponse,
    GroupScores,
    RolloutChunk,
    RolloutRequest,
    RolloutResponse,
    SampledChunk,
    TrajectoryBatch,
)
from serve_app.serving.coordinator import RolloutCoordinator, Scoring
from serve_app.serving.ingress import RolloutPlanner, to_response
from serve_app.weights import open_weight_store

logger = logging.getLogger("ray.serve")

api = FastAPI(
    title="flowgrpo-serve",
    description="FlowGRPO rollouts: groups of images with per-step log-probs, rewards and advantages.",
)


ERROR_RESPONSES = {
    400: {"model": ErrorResponse, "description": "The body is not JSON (field: body)."},
    409: {"model": ErrorResponse, "description": "The pinned policy version does not exist."},
    413: {"model": ErrorResponse, "description": "More samples or work than the app's limits (field named)."},
    422: {"model": ErrorResponse, "description": "A field is invalid (field named, with what is accepted)."},
    502: {"model": ErrorResponse, "description": "A reward failed after its retries (reward, prompt and cause named)."},
    503: {"model": ErrorResponse, "description": "Overloaded, or a chunk's replica died on every retry."},
}


@api.exception_handler(RequestValidationError)
async def _invalid_json(_: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI's errors have pydantic's shape, with "body" in front of the field path; a body that is
    # not JSON reports a character offset there, which means nothing to the caller.
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return JSONResponse(status_code=400, content=ErrorResponse(
            error="malformed_json", field="body", message=f"the body is not valid JSON: {first['msg']}").model_dump())
    error = InvalidRequestError.from_errors([{**first, "loc": tuple(p for p in first["loc"] if p != "body")}])
    return JSONResponse(status_code=422, content=ErrorResponse(
        error="invalid_request", field=error.field, message=error.message).model_dump())


def _running_in_a_replica() -> bool:
    """Whether this runs in a Serve replica of a Ray cluster (not in Serve's local testing mode)."""
    try:
        serve.get_replica_context()
    except RayServeException:
        return False
    return True


@serve.ingress(api)
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

    @api.post("/v1/rollouts", response_model=RolloutResponse, response_model_exclude_none=True,
              responses=ERROR_RESPONSES)
    async def http_rollout(self, request: RolloutRequest):
        try:
            batch = await self.rollout(request)
        except Exception as exc:
            status, body = http_error(exc)
            if status >= 500:
                logger.exception("rollout request failed with %d", status)
            return JSONResponse(status_code=status, content=body)
        images = await batch.fetch_images_async() if request.return_images else None
        return to_response(batch, images=images)

    @api.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok"}
