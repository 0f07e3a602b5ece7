"""The wheel a user installs (`pip install .`, not editable) carries what the package needs at run time: every
shipped world's checkpoint loads from it, the configs print, and the trainer's CLI starts.

Built here, installed into a fresh virtualenv beside the project's (which lends it the dependencies, torch and
the rest, through a .pth file, without its editable install of this package), and run from outside the
repository, so nothing can come from the checkout.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
WORLD_APPS = ["shapes_rollout", "motion_rollout", "edit_rollout"]  # each world's app config, naming its model
LOAD_WORLDS = """
import json, sys
import serve_app
from serve_app.config import load_config
from serve_app.policies import model_dir
from serve_app.policies import load_configured_policy
loaded = {}
for name in sys.argv[1:]:
    model = load_config(name).model
    policy = load_configured_policy(model)
    loaded[name] = [policy.family, str(model_dir(model)), sum(p.numel() for p in policy.transformer.parameters())]
print(json.dumps({"package": serve_app.__file__, "loaded": loaded}))
"""


def _run(python: Path, *args: str, cwd: Path, env: dict) -> str:
    done = subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_installed_wheel_loads_every_world_prints_a_config_and_starts_the_trainer(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTHON", "FLOWGRPO_CONFIG"))}
    # Built from a copy of the tracked files: a build writes into its source folder (build/, *.egg-info).
    source = tmp_path / "source"
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    for name in tracked.decode().split("\0"):
        if name and (REPO / name).exists():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name, follow_symlinks=False)
    _run(Path(sys.executable), "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path / "dist"), str(source),
         cwd=tmp_path, env=env)
    (wheel,) = (tmp_path / "dist").glob("flowgrpo_serve-*.whl")
    venv.EnvBuilder(with_pip=False).create(tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path, env=env).strip())
    # The project's packages, for the dependencies; a folder named in a .pth is not itself scanned for .pth files,
    # so the project's editable install of this package stays out.
    (site / "project_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(python, "-m", "pip", "install", "--quiet", "--no-deps", "--ignore-installed", str(wheel), cwd=tmp_path, env=env)

    report = json.loads(_run(python, "-c", LOAD_WORLDS, *WORLD_APPS, cwd=tmp_path, env=env))
    assert Path(report["package"]).is_relative_to(site)  # the installed copy, not the checkout
    assert [family for family, _, _ in report["loaded"].values()] == ["qwen_image", "wan", "qwen_image_edit"]
    for _, checkpoint, parameters in report["loaded"].values():  # each world's model, from the wheel
        assert Path(checkpoint).is_relative_to(site) and parameters > 0
    printed = _run(python, "-m", "serve_app.config", "shapes_rollout", "sampling.num_steps=7", cwd=tmp_path, env=env)
    assert "num_steps: 7" in printed and "serve_app.worlds.shapes.model:SHAPES_QWEN_IMAGE" in printed
    usage = _run(python, "-m", "serve_app.trainer", "--help", cwd=tmp_path, env=env)
    assert "--url" in usage and "--resume" in usage
