"""What the README and docs/ tell a user exists and works: every path, module, make target and config
they name, and every one-line model recipe of the README deploys and samples, by handle and over HTTP alike."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from serve_app.config import default_config_dir, load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP_FOLDERS = ("serve_app/", "deployments/", "configs/", "tests/", "benchmarks/", "docs/", "scripts/", "research/",
               ".ci/")
TOP_FILES = {"serve_config.yaml", "Makefile", "pyproject.toml", "README.md"}


def code_spans(path: Path) -> list[str]:
    """The text of every `code` span and every line of every fenced block."""
    text = path.read_text()
    fenced = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return inline + [line for block in fenced for line in block.splitlines()]


def named_paths(span: str) -> list[str]:
    """Repository paths a span names (placeholders such as DIR, <r> or * are not paths)."""
    found = []
    for token in re.split(r"[\s(),'\"=\[\]{}]+", span):
        token = token.split("::")[0].rstrip(".:;")  # a test's node id names its file
        if token.startswith(TOP_FOLDERS) or token in TOP_FILES:
            if not re.search(r"[<>*]|DIR|/path/to/", token):
                found.append(token)
    return found


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_path_a_doc_names_exists(doc):
    missing = sorted({p for span in code_spans(doc) for p in named_paths(span) if not (ROOT / p).exists()})
    assert missing == [], f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_every_result_file_the_results_page_cites_exists_and_every_kept_file_is_cited():
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    cited = set(re.findall(r"`([\w.-]+\.(?:json|csv|jsonl))`", text))
    kept = {p.name for p in (ROOT / "benchmarks" / "results").iterdir()}
    assert cited - kept == set(), "cited but missing"
    assert kept - cited == set(), "kept but cited nowhere: benchmarks/results keeps only what RESULTS.md cites"


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_module_command_and_make_target_a_doc_names_exists(doc):
    spans = code_spans(doc)
    modules = {m for span in spans for m in re.findall(r"python -m ([\w.]+)", span)}
    assert [m for m in modules if importlib.util.find_spec(m) is None] == []
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    named = {t for span in spans for t in re.findall(r"(?:^|\s)make ([\w-]+)", span)}
    assert named - targets == set()
    configs = {c for span in spans for c in re.findall(r"--config ([\w/]+)", span)}
    configs |= {f"{group}/{name}" for span in spans for group, name in re.findall(r"\b(model|reward)=(\w+)", span)}
    assert [c for c in configs if not (default_config_dir() / f"{c}.yaml").is_file()] == []


def readme_recipes() -> list[tuple[str, str | None, list[str]]]:
    """(app, config, overrides) of each line between the README's recipe markers."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- recipes:")[1].split("<!-- /recipes -->")[0]
    recipes = []
    for line in block.splitlines():
        match = re.match(r"\| (.+?) \| (?:`config: (\w+)` with )?`\[(.*)\]`", line)
        if match:
            app, config, overrides = match.groups()
            recipes.append((app, config, [o.strip() for o in overrides.split(",") if o.strip()]))
    return recipes


def test_the_readme_has_recipes():
    assert len(readme_recipes()) >= 6


@pytest.mark.slow
@pytest.mark.parametrize(("app", "config", "overrides"), readme_recipes(), ids=[r[0] for r in readme_recipes()])
def test_each_readme_recipe_is_a_working_app(app, config, overrides, start_local_app):
    from serve_app.http_client import HttpRolloutClient
    from serve_app.schemas import RolloutRequest
    from tests.http_server import assert_same_batch, serve_http

    if any(o.startswith("model.path=") for o in overrides):
        # A local checkpoint on GPUs cannot run here: its config must compose and validate.
        cfg = load_config(config or "diffusion_rollout", overrides)
        assert cfg.model.path is not None and cfg.replica.num_gpus >= 1
        return
    prompt = "a red circle moving left to right" if "reward=motion_direction" in overrides else "a red circle"
    small = ["sampling.num_steps=4", "sampling.sde_window_range=[0,2]"]
    handle = start_local_app(config or "diffusion_rollout", [*overrides, *small], name=f"recipe-{abs(hash(app))}")
    batch = handle.rollout.remote(RolloutRequest(prompts=[prompt], group_size=2, seed=3)).result()
    assert len(batch) == 2 and batch.rewards["total"].isfinite().all()
    frames = load_config(config or "diffusion_rollout", overrides).sampling.num_frames
    images = batch.trajectory.images
    assert images.shape[:2] == (2, frames) if frames > 1 else images.shape[:2] == (2, 3)
    # Every family's trajectories over HTTP are the handle's, bitwise.
    with serve_http(handle) as url:
        assert_same_batch(HttpRolloutClient(url).rollout([prompt], group_size=2, seed=3), batch)


# Commands the docs give that take seconds, run as written: from the repository root, no RAY_* variable
# exported (the benchmark scripts' own smoke runs do the same: tests/benchmarks/test_benchmark_scripts.py).
CHEAP_COMMANDS = [
    ("-m", "serve_app.config", "shapes_rollout", "sampling.num_steps=7"),
    ("-m", "serve_app.trainer", "--help"),
]


@pytest.mark.parametrize("command", CHEAP_COMMANDS, ids=[" ".join(c[1:]) for c in CHEAP_COMMANDS])
def test_cheap_documented_commands_run_as_written(command):
    import os
    import subprocess
    import sys

    documented = "\n".join(line for doc in DOCS for line in code_spans(doc))
    assert f"python {' '.join(command[:2])}" in documented, "the docs no longer give this command"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()
