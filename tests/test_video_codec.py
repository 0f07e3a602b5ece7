import io

import av
import numpy as np
import pytest
import torch

from serve_app.worlds.motion import MotionSpec, render
from serve_app.media import DEFAULT_FPS, decode_mp4, encode_mp4

# Mean absolute error (0-255) of a round trip through H.264 yuv420p at crf 18, measured: 3.2 on the
# moving circle below and 5.0 on a two-object shapes scene (hard colour edges, chroma at half
# resolution); 0.9-1.3 on the smooth gradients below.
MAX_SHAPES_ERROR = 10.0
MAX_SMOOTH_ERROR = 3.0


def moving_shapes(frames: int = 8, seed: int = 0) -> np.ndarray:
    return render(MotionSpec.of("red", "circle", "left to right"), np.random.default_rng(seed), frames=frames)


def smooth(frames: int, h: int, w: int) -> np.ndarray:
    """Gradients that drift from frame to frame: no edges for the codec to smear."""
    f, c, y, x = np.meshgrid(np.arange(frames), np.arange(3), np.arange(h), np.arange(w), indexing="ij")
    return (40 + 30 * c + 2 * y + 2 * x + 3 * f).astype(np.uint8)  # at most 232: no wrap-around


def mae(a, b) -> float:
    return float((torch.as_tensor(a).float() - torch.as_tensor(b).float()).abs().mean())


def test_round_trip_keeps_frames_size_and_order():
    video = moving_shapes()
    data = encode_mp4(video)
    decoded = decode_mp4(data)
    assert decoded.dtype == torch.uint8 and decoded.shape == (8, 3, 32, 32)
    assert mae(decoded, video) < MAX_SHAPES_ERROR
    # Each decoded frame is nearest its own source frame: no frame dropped, repeated or reordered.
    errors = np.array([[mae(d, v) for v in video] for d in decoded])
    assert (errors.argmin(1) == np.arange(8)).all()
    assert mae(decoded, video[::-1].copy()) > 2 * mae(decoded, video)  # measured 17.7 against 3.2


def test_file_is_h264_yuv420p_mp4_at_the_asked_rate():
    data = encode_mp4(torch.from_numpy(moving_shapes(frames=5)), fps=8)
    assert data[4:8] == b"ftyp"
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264" and stream.codec_context.pix_fmt == "yuv420p"
        assert stream.average_rate == 8 and (stream.width, stream.height) == (32, 32)
        assert sum(1 for _ in container.decode(video=0)) == 5
    with av.open(io.BytesIO(encode_mp4(moving_shapes(frames=2)))) as container:
        assert container.streams.video[0].average_rate == DEFAULT_FPS


@pytest.mark.parametrize("h, w", [(33, 31), (17, 32), (32, 9)])
def test_odd_sizes_are_padded_to_even_by_repeating_the_edge(h, w):
    video = smooth(3, h, w)
    decoded = decode_mp4(encode_mp4(video))
    assert decoded.shape == (3, 3, h + h % 2, w + w % 2)
    assert mae(decoded[:, :, :h, :w], video) < MAX_SMOOTH_ERROR
    assert mae(decoded[:, :, -1, :w], video[:, :, -1]) < 2 * MAX_SMOOTH_ERROR  # the last row, again (or itself)
    assert mae(decoded[:, :, :h, -1], video[:, :, :, -1]) < 2 * MAX_SMOOTH_ERROR


def test_a_single_frame_video():
    decoded = decode_mp4(encode_mp4(smooth(1, 16, 16)))
    assert decoded.shape == (1, 3, 16, 16) and mae(decoded, smooth(1, 16, 16)) < MAX_SMOOTH_ERROR


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match=r"uint8 \[F, 3, H, W\]"):
        encode_mp4(np.zeros((3, 32, 32), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"uint8 \[F, 3, H, W\]"):
        encode_mp4(np.zeros((2, 3, 32, 32), dtype=np.float32))
    with pytest.raises(ValueError, match=r"uint8 \[F, 3, H, W\]"):
        encode_mp4(np.zeros((0, 3, 32, 32), dtype=np.uint8))
    with pytest.raises(ValueError, match="fps"):
        encode_mp4(moving_shapes(2), fps=0)
    with pytest.raises(ValueError, match="crf"):
        encode_mp4(moving_shapes(2), crf=0)
    with pytest.raises(ValueError, match="not a readable video"):
        decode_mp4(b"definitely not an mp4")
