"""TokenizerIngress: the app's entry (HTTP and handle). Validates, tokenizes, fans out to the
replicas, hands their responses to the aggregator."""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray import serve
from ray.serve import metrics
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from serve_app.config import RolloutConfig
from serve_app.errors import InvalidRequestError, RolloutError
from serve_app.options import check_running_options
from serve_app.planner import RolloutPlanner
from serve_app.rewards import TOTAL_KEY, RewardError
from serve_app.schemas import RolloutRequest, RolloutResponse, SampleOut, TrajectoryBatch
from serve_app.weights import open_weight_store

logger = logging.getLogger("ray.serve")

api = FastAPI(
    title="flowgrpo-serve",
    description="FlowGRPO rollouts: groups of images with per-step log-probs, rewards and advantages.",
)


def _error(status: int, kind: str, message: str, field: str = "") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": kind, "field": field, "message": message})


@api.exception_handler(RequestValidationError)
async def _invalid_json(_: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI's errors have pydantic's shape, with "body" in front of the field path.
    first = exc.errors()[0]
    error = InvalidRequestError.from_errors([{**first, "loc": tuple(p for p in first["loc"] if p != "body")}])
    return _error(422, "invalid_request", error.message, error.field)


def _png_base64(image) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def to_response(batch: TrajectoryBatch, *, return_images: bool) -> RolloutResponse:
    """JSON for people and other languages (trainers take the tensors by handle)."""
    t = batch.trajectory
    total = batch.rewards[TOTAL_KEY]
    samples = [
        SampleOut(
            prompt_index=int(t.prompt_index[i]),
            sample_index=int(t.sample_index[i]),
            seed=int(t.seeds[i]),
            reward=float(total[i]),
            advantage=float(batch.advantages[i]),
            log_probs=t.log_probs[i].tolist(),
            image_png_base64=_png_base64(t.images[i]) if return_images else None,
        )
        for i in range(len(t))
    ]
    return RolloutResponse(
        policy_version=batch.policy_version, request_id=batch.request_id, samples=samples, metrics=batch.metrics
    )


@serve.ingress(api)
class TokenizerIngress:
    def __init__(self, replica: DeploymentHandle, aggregator: DeploymentHandle, config: RolloutConfig) -> None:
        from serve_app.policies import load_text_processor, model_dir

        check_running_options(config, "TokenizerIngress")
        self.planner = RolloutPlanner(
            load_text_processor(model_dir(config.model), family=config.model.family),
            config.ingress,
            config.sampling,
            open_weight_store(config),
        )
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
            plan = await asyncio.to_thread(self.planner.plan, request)
            chunk_responses = [self.replica.generate.remote(chunk) for chunk in plan.chunks]
            batch = await self.aggregator.collect.remote(plan.prompts, plan.group_size, plan.request_id, *chunk_responses)
            batch.metrics["rollout_seconds"] = time.perf_counter() - started
            outcome = "ok"
            return batch
        finally:
            self.requests.inc(tags={"outcome": outcome})
            self.latency.observe(time.perf_counter() - started)

    @api.post("/v1/rollouts", response_model=RolloutResponse, response_model_exclude_none=True)
    async def http_rollout(self, request: RolloutRequest):
        try:
            batch = await self.rollout(request)
        except BackPressureError as exc:
            return _error(503, "overloaded", f"the rollout replicas are at capacity, retry later ({exc})")
        except InvalidRequestError as exc:
            return _error(exc.http_status, "invalid_request", exc.message, exc.field)
        except RewardError as exc:
            return _error(500, "reward", str(exc))
        except RolloutError as exc:
            return _error(exc.http_status, type(exc).__name__, str(exc))
        return to_response(batch, return_images=request.return_images)

    @api.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok"}
