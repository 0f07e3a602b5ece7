"""A command-line `main(argv)`, or a script, run in a process of its own, forked from a server that imported
it once.

Python's forkserver start method: the server imports TRAINER_MODULES once (torch, diffusers and the
trainer take about 8 s of CPU), and each run is a fresh child forked from it, with the environment given, its own
pid and its own output. A test that starts many short trainers or scripts, and kills some, pays the imports once.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Finished:
    returncode: int  # -N when signal N ended it, as subprocess reports it
    output: str  # stderr, and stdout unless the run gave it a file of its own


def _main_in_child(target: str, argv: list[str], env: dict[str, str], log: str, stdout: str | None) -> None:
    os.environ.clear()
    os.environ.update(env)
    with open(log, "wb") as out:
        os.dup2(out.fileno(), 2)
        if stdout is None:
            os.dup2(out.fileno(), 1)
    if stdout is not None:
        with open(stdout, "wb") as out:
            os.dup2(out.fileno(), 1)
    module, name = target.split(":")
    sys.exit(getattr(import_module(module), name)(argv))


def script_main(argv: list[str]) -> int:
    """`python <argv[0]> <argv[1:]>` in the repository root: the script runs as __main__ with its folder first on
    sys.path, as the interpreter would put it (a target for ForkedRun)."""
    os.chdir(REPO)
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    runpy.run_path(argv[0], run_name="__main__")
    return 0


# What a trainer process imports: the server imports it once, when it starts, for every run of the session.
TRAINER_MODULES = ("serve_app.trainer.__main__", "serve_app.trainer.loop", "serve_app.http_client",
                   "serve_app.policies.qwen_image", "torch.distributed.fsdp")


class ForkedRun:
    """`target` ("module:function", called with argv) running in a child of the forkserver."""

    def __init__(self, target: str, argv: Sequence[str], *, env: dict[str, str], log: Path, stdout: Path | None = None):
        """Its stdout and stderr go to `log`; with `stdout`, its stdout goes there apart."""
        # The server takes this process's sys.path when it starts, and imports `target` and this module by name:
        # under the `pytest` entry point (not `python -m pytest`) the repository root is not on it.
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(TRAINER_MODULES))
        self.what, self.log = f"{target} {' '.join(argv)}", Path(log)
        self.child = context.Process(target=_main_in_child, args=(target, list(argv), dict(env), str(log),
                                                                  None if stdout is None else str(stdout)))
        self.child.start()

    def wait(self, timeout_s: float) -> Finished:
        """Its exit status and output; killed, and TimeoutError, after timeout_s."""
        self.child.join(timeout_s)
        if self.child.is_alive():
            self.child.kill()
            self.child.join()
            raise TimeoutError(f"{self.what} ran past {timeout_s} s:\n{self._output()[-3000:]}")
        return Finished(self.child.exitcode, self._output())

    def _output(self) -> str:
        # A child that failed before it opened its log (it could not import `target`) says so on the server's stderr.
        return self.log.read_text() if self.log.exists() else f"no output: see stderr for {self.what}"


def run_forked(target: str, argv: Sequence[str], *, env: dict[str, str], log: Path, timeout_s: float,
               stdout: Path | None = None) -> Finished:
    return ForkedRun(target, argv, env=env, log=log, stdout=stdout).wait(timeout_s)
