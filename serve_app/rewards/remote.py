"""Rewards scored by a remote service over HTTP: a JSON scoring API and an OpenAI-compatible VLM judge.

Both send images as base64 PNG inside JSON and read JSON back with ``json.loads`` only (nothing is
ever unpickled from the network). Both share the transport rules of :class:`JsonPoster`:

* ``timeout_s`` bounds each connect and each read (urllib's socket timeout), per attempt;
* ``retry`` (a :class:`~serve_app.retry.RetryPolicy`, default 3 attempts, backoff 0.5 s up to 8 s):
  only connection errors, timeouts, HTTP 429 and 5xx are retried, and a numeric ``Retry-After``
  stretches the wait up to the cap. Other statuses, redirects (never followed) and malformed replies
  fail at once: repeating them would give the same answer. (A reward component's own ``retry``
  repeats the whole reward call; this one repeats a single POST.);
* at most ``max_concurrency`` requests in flight per process and endpoint URL, whatever the number
  of rewards or threads using it (the first reward built for an endpoint sets the limit; a later
  one asking for another limit is an error);
* an API key is read from the environment variable named by ``api_key_env`` and sent as
  ``Authorization: Bearer <key>``; keys never appear in configs.

A failure after the last attempt raises :class:`RemoteRewardError` naming the endpoint, the status or
cause and the number of attempts; a CompositeReward turns it into a RewardError naming the reward
and the prompt, so an error is never scored as a number.

Both take images uint8 ``[B, 3, H, W]`` or, from a video family, videos uint8 ``[B, F, 3, H, W]``
(one score per video, judged as a whole: a judge that sees the frames in order can tell a direction
of motion, which no reduction of per-frame scores can).

``remote_score`` schema (one POST per batch, or per ``batch_size`` samples)::

    request:  {"images": ["<base64 PNG>", ...], "prompts": ["<prompt of image i>", ...]}
          or  {"videos": [["<base64 PNG of frame 0>", ...], ...], "prompts": ["<prompt of video i>", ...]}
    response: {"scores": [<finite number>, ...]}      # one per image or video, same order; other keys ignored

``vlm_judge``: one ``POST {base_url}/chat/completions`` per sample, a user message holding the
question (``question.format(prompt=...)``, or ``video_question`` for a video) and then the image, or
up to ``max_frames`` frames of the video evenly spaced in time order (the first and the last
included), each as a ``data:image/png;base64,...`` URL - the multi-image form OpenAI-compatible VLM
servers accept; the reply's ``choices[0].message.content`` is parsed by :func:`parse_score`.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import ssl
import string
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from serve_app.media import png_base64
from serve_app.retry import RetryPolicy

from .registry import RewardFn, register_reward
from .video import check_sample_batch

__all__ = ["JsonPoster", "RemoteRewardError", "encode_samples", "parse_score", "remote_score",
           "spaced_frames", "vlm_judge"]

_MAX_RESPONSE_BYTES = 8 << 20  # a reply of scores is a few kB; refuse to buffer anything huge

DEFAULT_QUESTION = (
    'Does this image show "{prompt}"? Rate how well it matches from 0 (not at all) to 10 (perfectly). '
    "Reply in the form 'Score: N'."
)
DEFAULT_VIDEO_QUESTION = (
    'These are frames of one video, in time order. Does the video show "{prompt}"? Rate how well it '
    "matches from 0 (not at all) to 10 (perfectly). Reply in the form 'Score: N'."
)


class RemoteRewardError(RuntimeError):
    """A remote scorer failed: ``endpoint``, ``cause`` (HTTP status or error) and the ``attempts`` made
    (None when the request went through but its reply was unusable)."""

    def __init__(self, endpoint: str, cause: str, attempts: int | None) -> None:
        self.endpoint = endpoint
        self.cause = cause
        self.attempts = attempts
        if attempts is None:
            message = f"POST {endpoint}: unusable reply: {cause}"
        else:
            message = f"POST {endpoint} failed after {attempts} attempt{'' if attempts == 1 else 's'}: {cause}"
        super().__init__(message)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # Survives Ray's pickling with its fields (the default would pass only the message).
        return (type(self), (self.endpoint, self.cause, self.attempts))


class _Retryable(Exception):
    def __init__(self, cause: str, retry_after_s: float | None = None) -> None:
        super().__init__(cause)
        self.cause = cause
        self.retry_after_s = retry_after_s


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    # urllib would turn a redirected POST into a bodyless GET; a scorer that redirects is misconfigured.
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)

_LIMITS: dict[str, tuple[int, threading.BoundedSemaphore]] = {}
_LIMITS_LOCK = threading.Lock()


def _endpoint_semaphore(url: str, limit: int) -> threading.BoundedSemaphore:
    with _LIMITS_LOCK:
        if url not in _LIMITS:
            _LIMITS[url] = (limit, threading.BoundedSemaphore(limit))
        existing, semaphore = _LIMITS[url]
    if existing != limit:
        raise ValueError(
            f"max_concurrency={limit} for {url}, but this process already limits that endpoint to {existing}; "
            "the limit is shared per endpoint, so every reward using it must ask for the same one"
        )
    return semaphore


def _api_key(api_key_env: str | None) -> str | None:
    if api_key_env is None:
        return None
    key = os.environ.get(api_key_env)
    if not key:
        raise ValueError(f"api_key_env names the environment variable {api_key_env!r}, which is not set (or empty)")
    return key


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name} in JSON")


# A scorer that is briefly unreachable or overloaded (429, 5xx) usually answers a moment later.
DEFAULT_RETRY = RetryPolicy(attempts=3, backoff_s=0.5, max_backoff_s=8.0)


def _retry_policy(retry: RetryPolicy | dict | None) -> RetryPolicy:
    return DEFAULT_RETRY if retry is None else RetryPolicy.model_validate(retry)


def _retry_after(value: str | None) -> float | None:
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: fall back to our own backoff
    return seconds if seconds is not None and math.isfinite(seconds) and seconds >= 0 else None


class JsonPoster:
    """POSTs JSON to one endpoint with a timeout, retries with backoff and a per-endpoint concurrency limit."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        retry: RetryPolicy,
        max_concurrency: int,
        api_key_env: str | None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"endpoint must be an http:// or https:// URL, got {url!r}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.url = url
        self.timeout_s = float(timeout_s)
        self.retry = retry
        self.max_concurrency = max_concurrency
        self._semaphore = _endpoint_semaphore(url, max_concurrency)
        key = _api_key(api_key_env)
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if key is not None:
            self._headers["Authorization"] = f"Bearer {key}"

    def post(self, payload: Any) -> Any:
        """The decoded JSON reply to ``payload``.

        Raises:
            RemoteRewardError: no usable reply after the allowed attempts (or a non-retryable failure).
        """
        body = json.dumps(payload).encode()
        attempts = 0

        def post_once() -> Any:
            nonlocal attempts
            attempts += 1
            with self._semaphore:
                return self._post_once(body, attempts)

        try:
            return self.retry.call(post_once, retryable=lambda exc: isinstance(exc, _Retryable))
        except _Retryable as e:
            raise RemoteRewardError(self.url, e.cause, attempts) from None

    def _post_once(self, body: bytes, attempt: int) -> Any:
        request = urllib.request.Request(self.url, data=body, headers=self._headers, method="POST")
        try:
            with _OPENER.open(request, timeout=self.timeout_s) as response:
                raw = response.read(_MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as e:
            detail = _error_body(e)
            cause = f"HTTP {e.code}{': ' + detail if detail else ''}"
            if e.code == 429 or 500 <= e.code < 600:
                raise _Retryable(cause, _retry_after(e.headers.get("Retry-After"))) from None
            if 300 <= e.code < 400:
                cause += " (redirects are not followed; use the final URL)"
            raise RemoteRewardError(self.url, cause + " (not retried)", attempt) from None
        except OSError as e:  # urllib.error.URLError is an OSError
            # URLError wraps refused/unreachable connections; a bare TimeoutError/OSError is a read
            # that timed out or a connection dropped mid-reply.
            reason = e.reason if isinstance(e, urllib.error.URLError) else e
            if isinstance(reason, ssl.SSLCertVerificationError):
                raise RemoteRewardError(self.url, f"{reason} (not retried)", attempt) from None
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                raise _Retryable(f"timed out after {self.timeout_s:g} s") from None
            raise _Retryable(f"{type(reason).__name__}: {reason}") from None
        except http.client.HTTPException as e:  # a reply that is not (complete) HTTP
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        if len(raw) > _MAX_RESPONSE_BYTES:
            raise RemoteRewardError(self.url, f"reply larger than {_MAX_RESPONSE_BYTES} bytes", None)
        try:
            return json.loads(raw, parse_constant=_reject_constant)
        except ValueError as e:
            raise RemoteRewardError(self.url, f"reply is not JSON ({e}): {_snippet(raw)}", None) from None


def _error_body(error: urllib.error.HTTPError) -> str:
    try:
        return _snippet(error.read(2048)) if error.fp is not None else ""
    except OSError:  # the body itself timed out or was cut: the status says enough
        return ""


def _snippet(raw: bytes, limit: int = 200) -> str:
    text = raw.decode("utf-8", errors="replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."


def encode_samples(samples: torch.Tensor) -> list[str] | list[list[str]]:
    """One base64 PNG per image of ``[B, 3, H, W]``, or per video of ``[B, F, 3, H, W]`` the list of its
    frames' PNGs in time order."""
    if samples.ndim == 4:
        return png_base64(samples)
    frames = samples.shape[1]
    flat = png_base64(samples.flatten(0, 1))
    return [flat[i : i + frames] for i in range(0, len(flat), frames)]


def spaced_frames(num_frames: int, max_frames: int) -> list[int]:
    """At most ``max_frames`` frame indices evenly spaced over ``num_frames``, the first and the last
    included when there are two or more, in time order without repeats."""
    if num_frames <= max_frames:
        return list(range(num_frames))
    if max_frames == 1:
        return [0]
    return [round(k * (num_frames - 1) / (max_frames - 1)) for k in range(max_frames)]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parallel(fn: Any, items: list[Any], workers: int) -> list[Any]:
    if len(items) == 1 or workers == 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(fn, items))


@register_reward("remote_score", takes="any")
def remote_score(
    url: str,
    batch_size: int | None = None,
    timeout_s: float = 30.0,
    retry: RetryPolicy | dict | None = None,
    max_concurrency: int = 4,
    api_key_env: str | None = None,
) -> RewardFn:
    """reward = the ``scores`` a JSON scoring service returns for ``{"images", "prompts"}`` (module doc).

    ``batch_size``: images per request (None: the whole batch in one request); the requests of a
    batch run concurrently within ``max_concurrency``. Transport arguments: see the module doc.
    """
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    poster = JsonPoster(
        url, timeout_s=timeout_s, retry=_retry_policy(retry), max_concurrency=max_concurrency, api_key_env=api_key_env,
    )

    def score_chunk(chunk: tuple[str, list[Any], list[str]]) -> list[float]:
        kind, samples, prompts = chunk
        reply = poster.post({kind: samples, "prompts": prompts})
        scores = reply.get("scores") if isinstance(reply, dict) else None
        if not isinstance(scores, list) or len(scores) != len(samples) or not all(_is_number(s) for s in scores):
            raise RemoteRewardError(
                url, f'reply must be {{"scores": [{len(samples)} numbers]}}, got {_snippet(json.dumps(reply).encode())}', None
            )
        return [float(s) for s in scores]

    def reward(samples: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_sample_batch(samples, prompts)
        kind = "videos" if samples.ndim == 5 else "images"
        encoded = encode_samples(samples)
        step = batch_size or len(encoded)
        chunks = [(kind, encoded[i : i + step], list(prompts[i : i + step])) for i in range(0, len(encoded), step)]
        scores = [s for part in _parallel(score_chunk, chunks, max_concurrency) for s in part]
        return torch.tensor(scores, dtype=torch.float32)

    return reward


_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_SCORE_LABEL = re.compile(rf"score\W{{0,3}}?({_NUMBER})", re.IGNORECASE)
_BARE_NUMBER = re.compile(rf"\s*({_NUMBER})\s*(?:/\s*{_NUMBER}\s*)?\.?\s*")


def parse_score(reply: str, *, min_score: float, max_score: float) -> float:
    """The score in a judge's reply, by the first rule that applies:

    1. the reply is a JSON object with a numeric ``"score"``;
    2. the first number after the word "score" (any case), e.g. "Score: 7", "score = 7/10";
    3. the whole reply is one number, optionally "/ N" (e.g. "7", "7/10", "8.5.").

    Any other reply, or a number outside ``[min_score, max_score]``, raises ValueError quoting the
    reply: the judge is never assumed to have meant a default score.
    """
    score: float | None = None
    try:
        parsed = json.loads(reply, parse_constant=_reject_constant)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and _is_number(parsed.get("score")):
        score = float(parsed["score"])
    elif (label := _SCORE_LABEL.search(reply)) is not None:
        score = float(label.group(1))
    elif (bare := _BARE_NUMBER.fullmatch(reply)) is not None:
        score = float(bare.group(1))
    if score is None:
        raise ValueError(f"no score found in the judge's reply {_snippet(reply.encode())!r}")
    if not (math.isfinite(score) and min_score <= score <= max_score):
        raise ValueError(f"score {score:g} outside [{min_score:g}, {max_score:g}] in the judge's reply {_snippet(reply.encode())!r}")
    return score


def _message_text(reply: Any) -> str:
    try:
        content = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"not a chat completion (no choices[0].message.content): {_snippet(json.dumps(reply).encode())}") from None
    if isinstance(content, list):  # some servers answer in content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise ValueError(f"choices[0].message.content is a {type(content).__name__}, not text")
    return content


def _check_question(question: str) -> None:
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(question) if f is not None}
    except ValueError as e:
        raise ValueError(f"question is not a valid format string ({e}): {question!r}") from e
    if fields != {"prompt"}:
        raise ValueError(f"question must use the field {{prompt}} and no other, got fields {sorted(fields)} in {question!r}")


@register_reward("vlm_judge", takes="any")
def vlm_judge(
    base_url: str,
    model: str,
    question: str = DEFAULT_QUESTION,
    video_question: str = DEFAULT_VIDEO_QUESTION,
    max_frames: int = 8,
    min_score: float = 0.0,
    max_score: float = 10.0,
    max_tokens: int = 64,
    temperature: float = 0.0,
    timeout_s: float = 60.0,
    retry: RetryPolicy | dict | None = None,
    max_concurrency: int = 4,
    api_key_env: str | None = None,
) -> RewardFn:
    """reward = the score an OpenAI-compatible vision-language model gives each image or video (module doc).

    ``base_url``: the API root, e.g. ``http://127.0.0.1:8000/v1`` (``/chat/completions`` is
    appended); ``model``: the served model name; ``question`` / ``video_question``: templates with
    ``{prompt}`` for an image / a video, of which at most ``max_frames`` frames are sent (servers cap
    images per request, e.g. vLLM's ``--limit-mm-per-prompt``); the reply is parsed by
    :func:`parse_score` within ``[min_score, max_score]``. Samples of a batch are judged concurrently
    within ``max_concurrency``. Transport arguments: see the module doc.
    """
    _check_question(question)
    _check_question(video_question)
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    if not min_score < max_score:
        raise ValueError(f"need min_score < max_score, got {min_score} and {max_score}")
    url = base_url.rstrip("/") + "/chat/completions"
    poster = JsonPoster(
        url, timeout_s=timeout_s, retry=_retry_policy(retry), max_concurrency=max_concurrency, api_key_env=api_key_env,
    )

    def judge(item: tuple[str | list[str], str]) -> float:
        sample, prompt = item
        template, pictures = (video_question, sample) if isinstance(sample, list) else (question, [sample])
        reply = poster.post({
            "model": model,
            "messages": [{
                "role": "user",
                "content": [
                    {"type": "text", "text": template.format(prompt=prompt)},
                    *({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}} for b64 in pictures),
                ],
            }],
            "max_tokens": max_tokens,
            "temperature": temperature,
        })
        try:
            return parse_score(_message_text(reply), min_score=min_score, max_score=max_score)
        except ValueError as e:
            raise RemoteRewardError(url, str(e), None) from None

    def reward(samples: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_sample_batch(samples, prompts)
        if samples.ndim == 5:
            samples = samples[:, spaced_frames(samples.shape[1], max_frames)]
        items = list(zip(encode_samples(samples), prompts))
        return torch.tensor(_parallel(judge, items, max_concurrency), dtype=torch.float32)

    return reward
