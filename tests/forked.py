"""A command-line `main(argv)` run in a process of its own, forked from a server that imported it once.

Python's forkserver start method: the server imports the `preload` modules once (torch, diffusers and the
trainer take about 8 s of CPU), and each run is a fresh child forked from it, with the environment given, its own
pid and its own output. A test that starts many short trainers, and kills some, pays the imports once.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path


@dataclass(frozen=True)
class Finished:
    returncode: int  # -N when signal N ended it, as subprocess reports it
    output: str  # stdout and stderr together


def _main_in_child(target: str, argv: list[str], env: dict[str, str], log: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    with open(log, "wb") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    module, name = target.split(":")
    sys.exit(getattr(import_module(module), name)(argv))


def run_forked(target: str, argv: Sequence[str], *, env: dict[str, str], log: Path, preload: Sequence[str],
               timeout_s: float) -> Finished:
    """Run `target` ("module:function", called with argv) in a child of the forkserver; kill it after timeout_s."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))  # read when the server starts: the first run of the session
    child = context.Process(target=_main_in_child, args=(target, list(argv), dict(env), str(log)))
    child.start()
    child.join(timeout_s)
    if child.is_alive():
        child.kill()
        child.join()
        raise TimeoutError(f"{target} {' '.join(argv)} ran past {timeout_s} s:\n{Path(log).read_text()[-3000:]}")
    return Finished(child.exitcode, Path(log).read_text())
