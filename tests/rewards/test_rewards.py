import io
import math
import pickle
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import ValidationError

from serve_app.rewards import (
    CompositeReward,
    RewardError,
    RewardSpec,
    build_reward,
    register_reward,
    registered_rewards,
)
from serve_app.rewards import registry as registry_mod


def solid(value, b=2, size=32):
    """Images [b, 3, size, size] of one colour; ``value`` is an int or an (r, g, b) triple."""
    rgb = torch.tensor(value if isinstance(value, (list, tuple)) else [value] * 3, dtype=torch.uint8)
    return rgb.view(1, 3, 1, 1).expand(b, 3, size, size).contiguous()


def noise(b=2, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, 3, size, size), dtype=torch.uint8, generator=g)


PROMPTS = ["a red cube", "a red cube"]


# --- built-ins ---------------------------------------------------------------------------------


def test_builtins_are_registered():
    names = registered_rewards()
    for name in ("jpeg_compressibility", "jpeg_incompressibility", "brightness", "color_target", "saturation"):
        assert name in names


def test_jpeg_flat_image_more_compressible_than_noise():
    comp = build_reward("jpeg_compressibility")
    flat, rand = comp(solid(128), PROMPTS), comp(noise(), PROMPTS)
    assert flat.shape == (2,) and flat.dtype == torch.float32
    assert (flat > rand).all()
    assert (flat < 0).all()
    incomp = build_reward("jpeg_incompressibility")
    assert (incomp(noise(), PROMPTS) > incomp(solid(128), PROMPTS)).all()


def test_jpeg_values_follow_ddpo_definition():
    img = noise(b=1, size=48)
    buf = io.BytesIO()
    Image.fromarray(img[0].permute(1, 2, 0).numpy()).save(buf, format="JPEG", quality=95)
    kb = buf.tell() / 1000
    assert build_reward("jpeg_incompressibility")(img, ["p"]).item() == pytest.approx(kb, rel=1e-6)
    assert build_reward("jpeg_compressibility")(img, ["p"]).item() == pytest.approx(-kb / 500, rel=1e-6)


def test_brightness():
    white, black = solid(255), solid(0)
    torch.testing.assert_close(build_reward("brightness")(white, PROMPTS), torch.full((2,), -0.2))
    torch.testing.assert_close(build_reward("brightness")(black, PROMPTS), torch.full((2,), -0.8))
    torch.testing.assert_close(build_reward("brightness", target=1.0)(white, PROMPTS), torch.zeros(2))
    with pytest.raises(ValueError, match="target"):
        build_reward("brightness", target=1.5)


def test_color_target():
    red = solid((255, 0, 0))
    torch.testing.assert_close(build_reward("color_target", rgb=[1.0, 0.0, 0.0])(red, PROMPTS), torch.zeros(2))
    # black vs red: channel errors (1, 0, 0) -> -sqrt(1/3)
    out = build_reward("color_target", rgb=[1, 0, 0])(solid(0), PROMPTS)
    torch.testing.assert_close(out, torch.full((2,), -math.sqrt(1 / 3)))
    with pytest.raises(ValueError, match="rgb"):
        build_reward("color_target", rgb=[1.0, 0.0])
    with pytest.raises(ValueError, match="bad args"):
        build_reward("color_target")  # rgb is required


def test_saturation():
    sat = build_reward("saturation")
    torch.testing.assert_close(sat(solid(128), PROMPTS), torch.zeros(2))
    torch.testing.assert_close(sat(solid(0), PROMPTS), torch.zeros(2))
    torch.testing.assert_close(sat(solid((255, 0, 0)), PROMPTS), torch.ones(2))


def test_builtins_reject_bad_batches():
    with pytest.raises(ValueError, match="uint8"):
        build_reward("brightness")(solid(0).float(), PROMPTS)
    with pytest.raises(ValueError, match="prompts"):
        build_reward("brightness")(solid(0), ["only one"])


# --- registry and import paths -----------------------------------------------------------------


def test_unknown_name_lists_registered_and_mentions_import_paths():
    with pytest.raises(ValueError) as info:
        build_reward("aesthetic")
    msg = str(info.value)
    assert "'aesthetic'" in msg
    for name in ("brightness", "color_target", "jpeg_compressibility", "jpeg_incompressibility"):
        assert name in msg
    assert "module:attribute" in msg


def test_import_path_to_builtin_factory_with_args():
    fn = build_reward("serve_app.rewards.builtin:brightness", target=1.0)
    torch.testing.assert_close(fn(solid(255), PROMPTS), torch.zeros(2))


@pytest.fixture
def fake_module(monkeypatch):
    # Registered in sys.modules so importlib finds it whatever pytest's import mode is.
    mod = types.ModuleType("_fake_reward_module")

    def plain(images, prompts):
        return torch.full((images.shape[0],), 7.0)

    def factory(value=1.0):
        return lambda images, prompts: torch.full((images.shape[0],), float(value))

    class Constant:
        def __init__(self, value: float = 3.0) -> None:
            self.value = value

        def __call__(self, images, prompts):
            return torch.full((images.shape[0],), self.value)

        @staticmethod
        def make(value: float = 4.0):
            return Constant(value)

    mod.plain, mod.factory, mod.Constant, mod.not_callable = plain, factory, Constant, 12
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod.__name__


def test_import_path_plain_factory_class_and_dotted(fake_module):
    imgs = solid(0)
    assert build_reward(f"{fake_module}:plain")(imgs, PROMPTS).tolist() == [7.0, 7.0]
    assert build_reward(f"{fake_module}:factory")(imgs, PROMPTS).tolist() == [1.0, 1.0]
    assert build_reward(f"{fake_module}:factory", value=2)(imgs, PROMPTS).tolist() == [2.0, 2.0]
    assert build_reward(f"{fake_module}:Constant", value=5.0)(imgs, PROMPTS).tolist() == [5.0, 5.0]
    assert build_reward(f"{fake_module}:Constant.make")(imgs, PROMPTS).tolist() == [4.0, 4.0]


def test_import_path_errors(fake_module):
    with pytest.raises(ValueError, match="no args"):
        build_reward(f"{fake_module}:plain", value=1)
    with pytest.raises(ValueError, match="bad args"):
        build_reward(f"{fake_module}:factory", nope=1)
    with pytest.raises(ValueError, match="no attribute"):
        build_reward(f"{fake_module}:missing")
    with pytest.raises(ValueError, match="non-callable"):
        build_reward(f"{fake_module}:not_callable")
    with pytest.raises(ValueError, match="cannot import"):
        build_reward("no_such_package_xyz.mod:fn")
    with pytest.raises(ValueError, match="invalid import path .* for the reward"):
        build_reward(":fn")


@pytest.fixture
def scratch_registry(monkeypatch):
    registry_mod._load_builtins()
    monkeypatch.setattr(registry_mod, "_REGISTRY", dict(registry_mod._REGISTRY))


def test_decorated_factory_with_two_required_args_is_a_factory(scratch_registry, fake_module, monkeypatch):
    # Without the decorator's mark, two required positional args would read as (images, prompts).
    @register_reward("test_two_args")
    def two_args(low, high):
        return lambda images, prompts: torch.full((images.shape[0],), float(high - low))

    monkeypatch.setattr(sys.modules[fake_module], "two_args", two_args, raising=False)
    fn = build_reward(f"{fake_module}:two_args", low=1, high=4)
    assert fn(solid(0), PROMPTS).tolist() == [3.0, 3.0]


def test_register_reward_decorator(scratch_registry):
    @register_reward("test_constant")
    def test_constant(value: float = 0.5):
        return lambda images, prompts: torch.full((images.shape[0],), value)

    assert "test_constant" in registered_rewards()
    assert build_reward("test_constant", value=0.25)(solid(0), PROMPTS).tolist() == [0.25, 0.25]
    with pytest.raises(ValueError, match="already registered"):
        register_reward("brightness")(test_constant)
    with pytest.raises(ValueError, match="invalid reward name"):
        register_reward("a:b")


# --- composite ---------------------------------------------------------------------------------


def test_weighted_total_equals_hand_sum():
    white = solid(255)
    comp = CompositeReward(
        [
            RewardSpec(name="brightness", weight=2.0),  # -0.2 each
            RewardSpec(name="color_target", weight=-0.5, args={"rgb": [0.0, 0.0, 0.0]}),  # -1.0 each
            RewardSpec(name="saturation", weight=3.0),  # 0 for white
        ]
    )
    out = comp.score(white, PROMPTS)
    assert list(out) == ["brightness", "color_target", "saturation", "total"]
    torch.testing.assert_close(out["brightness"], torch.full((2,), -0.2))
    torch.testing.assert_close(out["color_target"], torch.full((2,), -1.0))
    # 2 * -0.2 + -0.5 * -1.0 + 3 * 0 = 0.1
    torch.testing.assert_close(out["total"], torch.full((2,), 0.1))
    hand = 2.0 * out["brightness"] - 0.5 * out["color_target"] + 3.0 * out["saturation"]
    torch.testing.assert_close(out["total"], hand)


def test_repeated_names_are_disambiguated():
    comp = CompositeReward(
        [
            {"name": "brightness"},
            {"name": "brightness", "args": {"target": 0.0}},
            {"name": "brightness", "args": {"target": 1.0}},
        ]
    )
    out = comp.score(solid(255), PROMPTS)
    assert list(out) == ["brightness", "brightness_1", "brightness_2", "total"]
    torch.testing.assert_close(out["brightness_1"], torch.full((2,), -1.0))
    torch.testing.assert_close(out["total"], torch.full((2,), -1.2))


def test_disambiguation_avoids_explicit_names():
    from serve_app.rewards.composite import _unique_keys

    assert _unique_keys(["a", "a_1", "a"]) == ["a", "a_1", "a_2"]
    assert _unique_keys(["total", "x"]) == ["total_1", "x"]


def test_raising_reward_names_reward_and_prompt(fake_module, monkeypatch):
    def boom(images, prompts):
        raise RuntimeError("model fell over")

    monkeypatch.setattr(sys.modules[fake_module], "boom", boom, raising=False)
    comp = CompositeReward([RewardSpec(name="brightness"), RewardSpec(name=f"{fake_module}:boom")])
    with pytest.raises(RewardError) as info:
        comp.score(solid(0), ["a blue dog", "a blue dog"])
    err = info.value
    assert err.reward_name == f"{fake_module}:boom"
    assert err.prompt == "a blue dog"
    assert f"{fake_module}:boom" in str(err) and "a blue dog" in str(err) and "model fell over" in str(err)
    assert isinstance(err.__cause__, RuntimeError)
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.reward_name, clone.prompt, str(clone)) == (err.reward_name, err.prompt, str(err))


@pytest.mark.parametrize(
    ("output", "match"),
    [
        (lambda b: torch.zeros(b, 1), "shape"),
        (lambda b: torch.zeros(b + 1), "shape"),
        (lambda b: torch.tensor(0.0), "shape"),
        (lambda b: torch.tensor([0.0] + [float("nan")] * (b - 1)), "non-finite"),
        (lambda b: object(), "not a tensor"),
    ],
)
def test_bad_outputs_raise_reward_error(fake_module, monkeypatch, output, match):
    monkeypatch.setattr(sys.modules[fake_module], "bad", lambda images, prompts: output(images.shape[0]), raising=False)
    comp = CompositeReward([RewardSpec(name=f"{fake_module}:bad")])
    with pytest.raises(RewardError, match=match) as info:
        comp.score(solid(0), PROMPTS)
    assert info.value.prompt == "a red cube"


def test_numpy_output_is_accepted(fake_module, monkeypatch):
    monkeypatch.setattr(sys.modules[fake_module], "np_reward", lambda images, prompts: np.ones(2), raising=False)
    out = CompositeReward([RewardSpec(name=f"{fake_module}:np_reward", weight=0.5)]).score(solid(0), PROMPTS)
    assert out["total"].dtype == torch.float32
    assert out["total"].tolist() == [0.5, 0.5]


def test_composite_validates_inputs_and_specs():
    with pytest.raises(ValueError, match="at least one"):
        CompositeReward([])
    with pytest.raises(ValueError, match="unknown reward"):
        CompositeReward([RewardSpec(name="nope")])
    comp = CompositeReward([RewardSpec(name="brightness")])
    with pytest.raises(ValueError, match="prompts"):
        comp.score(solid(0), ["one"])
    with pytest.raises(ValidationError):
        RewardSpec(name="brightness", weight=float("inf"))
    with pytest.raises(ValidationError):
        RewardSpec(name="brightness", scale=2.0)
    spec = RewardSpec(name="x", args={"i": 1, "b": True, "f": 0.5, "s": "s", "l": [1, 2]})
    assert spec.args == {"i": 1, "b": True, "f": 0.5, "s": "s", "l": [1, 2]}
    assert type(spec.args["i"]) is int and type(spec.args["b"]) is bool
