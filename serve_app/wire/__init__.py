"""What crosses the HTTP API in binary: one container format (safetensors, read in place), the rollout
answer laid out in it, and weight uploads with the content hash that names them. Torch, safetensors' layout
and the shared schemas only: a trainer that talks HTTP imports this and nothing of Ray or the serving code.

- :mod:`~serve_app.wire.container`: pack / unpack, checked for what an untrusted body can get wrong.
- :mod:`~serve_app.wire.trajectory`: a TrajectoryBatch as a container (docs/http.md: the layout).
- :mod:`~serve_app.wire.weights`: a weight version as a container; content_hash.
"""

from serve_app.wire.container import WireFormatError, pack, unpack
from serve_app.wire.trajectory import TRAJECTORY_MEDIA_TYPE, decode_batch, encode_batch
from serve_app.wire.weights import WEIGHTS_MEDIA_TYPE, WeightUpload, content_hash, decode_weights, encode_weights

__all__ = [
    "TRAJECTORY_MEDIA_TYPE", "WEIGHTS_MEDIA_TYPE", "WeightUpload", "WireFormatError", "content_hash", "decode_batch",
    "decode_weights", "encode_batch", "encode_weights", "pack", "unpack",
]
