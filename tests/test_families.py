"""The family table (serve_app.families) is the one statement of each family's facts: its policy, pipelines,
checkpoints and configs agree with it, and the docs name every family, world and deployment that exists."""

import re
from pathlib import Path

import pytest
import yaml

from serve_app.config import ModelConfig, default_config_dir
from serve_app.config.schema import IMAGE_CONDITIONED_FAMILIES, VIDEO_FAMILIES
from serve_app.families import FAMILIES
from serve_app.imports import is_import_path
from serve_app.models import EMBEDDED_MODELS
from serve_app.policies import SUPPORTED_FAMILIES, policy_class

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_rows_policy_and_checkpoints_agree_with_it(name):
    row = FAMILIES[name]
    cls = policy_class(name)
    assert cls.family == name and cls.pipeline_class.__name__ in row.pipelines
    assert (cls.input_images != (0, 0)) == row.input_images
    assert row.checkpoints and any(c.role == "tiny" for c in row.checkpoints)
    for checkpoint in row.checkpoints:
        model = ModelConfig.model_validate(yaml.safe_load(
            (default_config_dir() / "model" / f"{checkpoint.config}.yaml").read_text()))
        assert (model.family, model.embedded) == (name, checkpoint.name)
        assert EMBEDDED_MODELS[checkpoint.name].family == name


def test_every_rows_text_processor_loads_and_tokenizes_without_diffusers(tiny_qwen_dir):
    """What an ingress replica imports: its deployment's module, each row's text processor module and the tiny
    checkpoint's tokenizers, in a fresh process that never imports diffusers (its import alone pulls torch._dynamo: seconds and ~300 MB)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import deployments.tokenizer_ingress\n"
            "from serve_app.families import FAMILIES\n"
            "from serve_app.imports import import_object\n"
            "from serve_app.policies import load_text_processor\n"
            "for name, row in FAMILIES.items():\n"
            "    import_object(row.text_processor, what=name)\n"
            "(tokens,) = load_text_processor(sys.argv[1], family='qwen_image').tokenize(['a cat'])\n"
            "assert len(tokens.token_ids['tokenizer']) > 34\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'diffusers'))\n")
    done = subprocess.run([sys.executable, "-c", code, str(tiny_qwen_dir)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_configs_and_the_registry_know_no_family_and_checkpoint_but_the_tables():
    assert SUPPORTED_FAMILIES == tuple(FAMILIES)
    assert VIDEO_FAMILIES == ("wan", "wan_i2v", "ltx2", "ltx2_i2v")
    assert set(IMAGE_CONDITIONED_FAMILIES) == {"qwen_image_edit", "qwen_image_edit_plus", "flux_kontext", "wan_i2v",
                                                 "ltx2_i2v", "flux2", "flux2_klein"}
    assert set(EMBEDDED_MODELS) == {c.name for row in FAMILIES.values() for c in row.checkpoints}
    for path in (default_config_dir() / "model").glob("*.yaml"):
        model = ModelConfig.model_validate(yaml.safe_load(path.read_text()))
        assert model.family in FAMILIES, path
        if model.path is None and not is_import_path(model.embedded):
            assert model.embedded in EMBEDDED_MODELS, path
    with pytest.raises(ValueError, match="supported: qwen_image, qwen_image_edit"):
        policy_class("stable_cascade")


def _worlds() -> list[str]:
    return sorted(p.name for p in (ROOT / "serve_app" / "worlds").iterdir() if (p / "__init__.py").is_file())


def _deployments() -> list[str]:
    """The deployment classes build_graph wires (serve_app/app.py)."""
    return sorted(re.findall(r"from deployments\.\w+ import (\w+)", (ROOT / "serve_app" / "app.py").read_text()))


@pytest.mark.parametrize("doc", ["docs/architecture.md", "docs/models.md"])
def test_the_docs_name_every_family_world_and_deployment(doc):
    text = (ROOT / doc).read_text()
    named = set(re.findall(r"`([\w.-]+)`", text))
    missing = [f for f in FAMILIES if f not in named]
    missing += [f"world {w}" for w in _worlds() if w not in named and f"worlds/{w}" not in text]
    missing += [d for d in _deployments() if d not in text]
    assert missing == [], f"{doc} does not name {missing}"
