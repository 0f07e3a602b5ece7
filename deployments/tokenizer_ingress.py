"""TokenizerIngress: the app's entry (HTTP and handle). Validates, tokenizes, fans out to the
replicas (re-running a chunk whose replica died), has each chunk scored by the aggregator as soon as
it arrives (while other chunks still sample), then has the aggregator assemble the batch."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayActorError
from ray.serve import metrics
from ray.serve.handle import DeploymentHandle

from serve_app.serving.aggregator import ScoreStream
from serve_app.config import RolloutConfig
from serve_app.errors import InvalidRequestError, ReplicaUnavailableError, http_error
from serve_app.serving.options import check_running_options
from serve_app.serving.ingress import RolloutPlanner, to_response
from serve_app.schemas import (
    ErrorResponse,
    GroupScores,
    RolloutChunk,
    RolloutRequest,
    RolloutResponse,
    ScoreJob,
    Trajectory,
    TrajectoryBatch,
)
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


async def _all_or_cancel(coroutines: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Their results in order; the first failure cancels the rest (a failed request stops sampling
    and scoring its other chunks) and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


@serve.ingress(api)
class TokenizerIngress:
    def __init__(self, replica: DeploymentHandle, aggregator: DeploymentHandle, config: RolloutConfig) -> None:
        from serve_app.policies import load_text_processor, model_dir

        check_running_options(config, "TokenizerIngress")
        self.config = config
        self.text_processor = load_text_processor(model_dir(config.model), family=config.model.family)
        self._planner: RolloutPlanner | None = None
        self._scoring: dict[str, bool] | None = None
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
            geometry = await self.replica.geometry.remote()
            self._planner = RolloutPlanner(
                self.text_processor, self.config.ingress, self.config.sampling, geometry,
                max_work=self.config.model.max_request_work, store=open_weight_store(self.config),
            )
        return self._planner

    async def scoring(self) -> dict[str, bool]:
        """Which score jobs the aggregator's rewards need (per-sample parts, whole groups), asked once."""
        if self._scoring is None:
            self._scoring = await self.aggregator.scoring.remote()
        return self._scoring

    async def score(self, jobs: list[ScoreJob]) -> list[GroupScores]:
        """The jobs scored by the aggregator, concurrently; its RewardError (fail closed) fails them all."""

        async def one(job: ScoreJob) -> GroupScores:
            return await self.aggregator.score.remote(job)

        return await _all_or_cancel([one(job) for job in jobs])

    async def sample(self, chunk: RolloutChunk) -> Trajectory:
        """One chunk on some replica. A replica that dies while holding it costs a re-run on another
        (or the restarted) one, not the request: the chunk's seeds make the re-run exactly the
        trajectory the undisturbed run returns."""
        policy = self.config.ingress.chunk_retry

        def rerun(exc: BaseException, failed: int) -> None:
            logger.warning("chunk lost with its replica (attempt %d of %d): %s", failed, policy.attempts, exc)
            self.chunk_reruns.inc()

        try:
            return await policy.call_async(lambda: self.replica.generate.remote(chunk),
                                           retryable=lambda exc: isinstance(exc, RayActorError), on_retry=rerun)
        except RayActorError:
            raise ReplicaUnavailableError(
                f"the replica running a chunk died {policy.attempts} times in a row (ingress.chunk_retry.attempts = "
                f"{policy.attempts}); retry the request"
            ) from None

    async def rollout(self, request: RolloutRequest | dict) -> TrajectoryBatch:
        """The trainer's entry: a TrajectoryBatch of tensors. Raises InvalidRequestError & co."""
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
            stream = ScoreStream(plan.prompts, plan.group_size, **await self.scoring())
            streaming = self.config.aggregator.score_while_sampling

            async def sample_and_score(chunk: RolloutChunk) -> tuple[Trajectory, list[GroupScores]]:
                trajectory = await self.sample(chunk)
                return trajectory, (await self.score(stream.add(trajectory)) if streaming else [])

            done = await _all_or_cancel([sample_and_score(chunk) for chunk in plan.chunks])
            trajectories = [trajectory for trajectory, _ in done]
            scores = [part for _, parts in done for part in parts]
            if not streaming:
                scores = await self.score([job for t in trajectories for job in stream.add(t)])
            batch = await self.aggregator.collect.remote(
                plan.prompts, plan.group_size, plan.request_id, scores, *trajectories
            )
            batch.metrics["rollout_seconds"] = time.perf_counter() - started
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
        return to_response(batch, return_images=request.return_images)

    @api.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok"}
