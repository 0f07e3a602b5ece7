"""Rehearsed pre-emption: the trainer SIGKILLs itself at a named point of a named step.

A pre-empted trainer dies between two instructions, with nothing flushed and no handler run. To check that
a run resumes into the run it would have been, kill it where the state on disk and in the service is the
least tidy; a kill from outside cannot aim at a window of microseconds (between publishing a version and
writing the checkpoint that records it). With

    FLOWGRPO_CRASH_AT=<phase>@<step>        e.g. FLOWGRPO_CRASH_AT=publish@3

the trainer kills itself with SIGKILL, which no code can catch, when it reaches `phase` of step `step`
(0-based, the step being trained). Phases, in the order a step meets them:

    rollout     the step's rollout is sent and not yet back (with max_staleness k, k more in flight)
    update      inside the update: after its first optimizer step, before the last
    publish     the step's version is published; the checkpoint that records it is not written
    checkpoint  the step's checkpoint is half written (its tensors are on disk, the directory not in place)

With --workers N, FLOWGRPO_CRASH_RANK=<r> picks the one rank that dies, and only in the first attempt: the
group Ray Train restarts runs on (serve_app.trainer.distributed).

Unset (always, outside such a rehearsal) it costs one environment lookup per point.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "FLOWGRPO_CRASH_AT"
PHASES = ("rollout", "update", "publish", "checkpoint")


def crash_point(phase: str, step: int) -> None:
    """SIGKILL this process if FLOWGRPO_CRASH_AT names `phase` of `step`."""
    if phase not in PHASES:
        raise ValueError(f"unknown crash phase {phase!r}; phases: {PHASES}")
    if os.environ.get(CRASH_ENV) == f"{phase}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def check_crash_env() -> None:
    """Fail at start, not at the step, when FLOWGRPO_CRASH_AT is set to something no point matches."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    phase, _, step = spec.partition("@")
    if phase not in PHASES or not step.isdigit():
        raise ValueError(f"{CRASH_ENV}={spec!r}: expected <phase>@<step> with a phase among {PHASES}, e.g. publish@3")
