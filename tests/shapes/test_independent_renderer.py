"""The checker on scenes from a renderer it was not written against (tests/shapes/independent_renderer.py)."""

from collections import Counter

import numpy as np

from serve_app.worlds.shapes import UNKNOWN, Verdict, check, sample_specs

N_SCENES = 2000


def failure_kind(verdict: Verdict) -> str:
    """The first thing that went wrong: count, colour, unknown (a shape not recognised) or shape."""
    if not verdict.count_ok:
        return "count"
    if not verdict.colour_ok:
        return "colour"
    if any(d.shape == UNKNOWN for d in verdict.detected):
        return "unknown"
    return "shape"


def background_kind(rgb: tuple[int, int, int]) -> str:
    if rgb in ((255, 255, 255), (0, 0, 0)):
        return "white" if rgb[0] else "black"
    return "grey" if len(set(rgb)) == 1 else "coloured"


def misread(scene, verdict: Verdict) -> list[str]:
    """The drawn objects the checker got wrong, each with what it saw there (by overlapping boxes)."""
    wrong = []
    for obj in scene.objects:
        x0, y0, x1, y1 = obj.box
        seen = [d for d in verdict.detected if d.bbox[0] < y1 and y0 < d.bbox[2] and d.bbox[1] < x1 and x0 < d.bbox[3]]
        if [(d.colour, d.shape) for d in seen] != [(obj.colour, obj.shape)]:
            saw = " + ".join(f"{d.colour} {d.shape}" for d in seen) or "nothing"
            wrong.append(f"{obj.colour} {obj.shape} {obj.side}px {obj.style} as {saw}".replace("  ", " "))
    return wrong


def test_checker_holds_on_an_independent_renderer(independent_renderer):
    rng = np.random.default_rng(2024)
    failures, kinds = [], Counter()
    for spec in sample_specs(rng, N_SCENES):
        scene = independent_renderer.draw_scene(spec, rng)
        verdict = check(scene.image, spec)
        if not verdict.strict:
            kind, backdrop = failure_kind(verdict), background_kind(scene.background)
            kinds[kind, backdrop] += 1
            wrong = "; ".join(misread(scene, verdict)) or "extra objects"
            failures.append(f"{kind} on {backdrop} {scene.background}: {wrong}")
    accuracy = 1 - len(failures) / N_SCENES
    print(f"checker strict accuracy on the independent renderer: {accuracy:.4f}")
    assert accuracy >= 0.99, (f"{accuracy:.1%} strict-correct; failures by (kind, background) {dict(kinds)}:\n"
                              + "\n".join(failures[:40]))
