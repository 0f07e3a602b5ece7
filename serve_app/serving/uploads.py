"""Weight versions from outside the cluster (POST /v1/weights): decoded, checked against the served model,
hashed and stored where the replicas read versions, under the next number.

Nothing is stored unless every check passes: a body that is not the format, tensors the model has no place
for or lacks, other shapes, dtypes that are not floats, NaN or infinite values, a content hash other than
the one the sender expects. Each is an error naming what is wrong (InvalidRequestError, 422;
WeightsHashMismatchError, 409).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from serve_app.errors import InvalidRequestError, WeightsHashMismatchError
from serve_app.api import PublishedVersion, VersionInfo, VersionList
from serve_app.weights import LoraSpec, VersionStore, WeightKind, content_hash
from serve_app.weights.layout import Layout, check_against_layout
from serve_app.wire import WireFormatError, decode_weights

LayoutCall = Callable[[WeightKind, LoraSpec | None], Awaitable[Layout]]


class WeightUploads:
    """Publishes uploaded versions to `store`; `layout(kind, lora)` gives the served model's (a replica's
    answer, kept per spec: the model does not change under a running app)."""

    def __init__(self, store: VersionStore, layout: LayoutCall) -> None:
        self.store = store
        self._layout = layout
        self._layouts: dict[tuple, Layout] = {}

    async def layout(self, kind: WeightKind, lora: LoraSpec | None) -> Layout:
        key = (kind, None if lora is None else (lora.rank, lora.alpha, tuple(lora.target_modules)))
        if key not in self._layouts:
            self._layouts[key] = await self._layout(kind, lora)
        return self._layouts[key]

    async def publish(self, body: bytearray) -> PublishedVersion:
        """Store the version `body` holds (serve_app.wire.weights) as the next one.

        Raises:
            InvalidRequestError: the body or its tensors are not a version of the served model (field named).
            WeightsHashMismatchError: the content hashes to another value than the upload says it expects.
        """
        try:
            upload = decode_weights(body)
        except WireFormatError as exc:
            raise InvalidRequestError(str(exc), "body") from None
        lora = None if upload.lora is None else LoraSpec(**upload.lora)
        layout = await self.layout(upload.kind, lora)
        tensors = upload.tensors
        # Hashing and the finiteness check read every byte: off the event loop.
        await asyncio.to_thread(check_against_layout, tensors, layout)
        if upload.expected_hash is not None:
            digest = await asyncio.to_thread(content_hash, tensors, lora)
            if digest != upload.expected_hash:
                raise WeightsHashMismatchError(
                    f"the uploaded weights hash to {digest}, the upload expects {upload.expected_hash}: changed in "
                    "transit, or hashed otherwise (docs/http.md states the hash); nothing was stored"
                )
        version, digest = await asyncio.to_thread(self.store.publish_next, tensors, kind=upload.kind, lora=lora)
        return PublishedVersion(policy_version=version, weights_hash=digest)

    def versions(self) -> VersionList:
        kept = self.store.versions()
        return VersionList(latest=kept[-1] if kept else 0, versions=[self.store.describe(v) for v in [0, *kept]])

    def describe(self, version: int) -> VersionInfo:
        """Raises PolicyVersionError (409) for a version the store does not hold."""
        return self.store.describe(version)
