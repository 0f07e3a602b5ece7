"""The binary container: safetensors exactly (the reference library reads ours and we read its), every dtype
carried bit for bit (bf16 included), tensors viewed in place, and every malformed body refused by name."""

import json

import pytest
import torch
from safetensors.torch import load as reference_load
from safetensors.torch import save as reference_save

from serve_app.wire import WireFormatError, pack, unpack


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "latents": torch.randn(3, 2, 4, 4, generator=g).to(torch.bfloat16),
        "log_probs": torch.randn(3, 2, generator=g),
        "half": torch.randn(5, generator=g).to(torch.float16),
        "double": torch.randn(2, generator=g, dtype=torch.float64),
        "index": torch.arange(3),
        "small": torch.tensor([-1, 2], dtype=torch.int8),
        "mask": torch.tensor([[True, False, True]]),
        "images": torch.randint(0, 256, (3, 3, 2, 2), generator=g, dtype=torch.uint8),
        "empty": torch.zeros(0, 7),
        "scalar": torch.tensor(1.5),
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), want[name].reshape(-1).view(torch.uint8)), name


def test_a_round_trip_keeps_every_dtype_shape_and_bit():
    want = tensors()
    want["latents"][0, 0, 0, 0] = float("nan")  # NaN payloads too: compared as bytes
    got, metadata = unpack(pack(want, {"format": "test", "n": 3}))
    assert metadata == {"format": "test", "n": 3}
    assert_same(got, want)


def test_the_reference_library_reads_ours_and_we_read_its():
    want = tensors()
    assert_same(reference_load(bytes(pack(want, {"a": 1}))), want)
    got, metadata = unpack(reference_save(want, metadata={"flowgrpo": json.dumps({"b": 2})}))
    assert metadata == {"b": 2}
    assert_same(got, want)


def test_unpack_views_the_buffer_without_copying():
    buffer = pack(tensors(), None)
    got, _ = unpack(buffer)
    start = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    for name, tensor in got.items():
        if tensor.numel():
            assert start <= tensor.data_ptr() < start + len(buffer), name
            assert tensor.data_ptr() % tensor.element_size() == 0, name  # aligned: largest elements first
    got["index"][0] = 41  # a view: writing it writes the buffer
    assert unpack(buffer)[0]["index"][0] == 41


def _header_and_data(buffer: bytearray) -> tuple[dict, bytes]:
    length = int.from_bytes(buffer[:8], "little")
    return json.loads(bytes(buffer[8:8 + length])), bytes(buffer[8 + length:])


def _rebuild(header: dict, data: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return len(encoded).to_bytes(8, "little") + encoded + data


def _edited(edit) -> bytes:
    header, data = _header_and_data(pack({"a": torch.zeros(4), "b": torch.ones(2, dtype=torch.int64)}, None))
    data = edit(header, data)
    return _rebuild(header, data)


@pytest.mark.parametrize(("body", "message"), [
    pytest.param(b"", "8-byte header length", id="empty"),
    pytest.param(b"\xff" * 8 + b"{}", "header length", id="huge-header-length"),
    pytest.param((5).to_bytes(8, "little") + b"{nope", "not JSON", id="header-not-json"),
    pytest.param((2).to_bytes(8, "little") + b"[]", "not a JSON object", id="header-a-list"),
    pytest.param(bytes(pack({"a": torch.zeros(4)}, None))[:-3], "past the", id="truncated"),
    pytest.param(_edited(lambda h, d: (h["a"].update(dtype="F128"), d)[1]), "dtype 'F128'", id="unknown-dtype"),
    pytest.param(_edited(lambda h, d: (h["a"].update(shape=[5]), d)[1]), "data_offsets span", id="wrong-shape"),
    pytest.param(_edited(lambda h, d: (h["a"].update(shape=[-4]), d)[1]), "non-negative", id="negative-shape"),
    pytest.param(_edited(lambda h, d: (h["a"].update(data_offsets=[8, 4]), d)[1]), "begin <= end", id="backwards"),
    pytest.param(_edited(lambda h, d: (h["b"].update(data_offsets=[4, 20]), d)[1]), "overlap or leave a hole",
                 id="overlap"),
    pytest.param(_edited(lambda h, d: d + b"xx"), "bytes after the last tensor", id="trailing-bytes"),
    pytest.param(_edited(lambda h, d: (h.update(__metadata__={"flowgrpo": 3}), d)[1]), "strings to strings",
                 id="metadata-not-strings"),
    pytest.param(_edited(lambda h, d: (h["a"].update(extra=1), d)[1]), "exactly dtype", id="extra-entry-key"),
])
def test_a_malformed_body_is_refused_naming_what_is_wrong(body, message):
    with pytest.raises(WireFormatError, match=message):
        unpack(body)


def test_pack_refuses_a_dtype_safetensors_cannot_name():
    with pytest.raises(WireFormatError, match="complex64"):
        pack({"z": torch.zeros(2, dtype=torch.complex64)}, None)
