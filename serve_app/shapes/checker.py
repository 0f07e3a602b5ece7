"""Rule-based checker: does an image show what a shapes-world prompt asks for?

Pipeline: label each pixel with the palette colour (or background) it is close to, or with
nothing; take 4-connected components per colour; drop specks; classify each component's shape.
A component is an object whatever its shape; its shape is "unknown" unless it passes every test
(aspect ratio, fill ratio of its bounding box, overlap with an ideal template of that shape and a
clean edge), so blurry or irregular blobs earn no shape credit by chance.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from .scene import BACKGROUND, COLOURS, SceneSpec, shape_mask

UNKNOWN = "unknown"


@dataclass(frozen=True)
class CheckParams:
    # Max RGB distance to a palette colour; palette colours are >= 170 apart, so no pixel is
    # close to two of them.
    colour_tol: float = 70.0
    # Components smaller than this fraction of the image are specks (20 px at 32x32; the smallest
    # rendered object, a 10 px triangle, has 60).
    min_area_frac: float = 20 / 1024
    # Longer over shorter side of the bounding box; rendered objects have 1.0.
    max_aspect: float = 1.3
    # Fill ratio (area / bounding-box area) bands; rendered values: circle 0.78-0.85, square 1.0,
    # triangle 0.56-0.63 (ideal shapes: 0.785, 1, 0.5).
    fill_bands: tuple[tuple[str, float, float], ...] = (
        ("circle", 0.70, 0.90),
        ("square", 0.92, 1.00),
        ("triangle", 0.45, 0.68),
    )
    # Intersection over union with the shape's template stretched to the bounding box.
    min_iou: float = 0.85
    # Fraction of the 1-px ring around a component that must be background or another palette
    # colour: a crisp edge. Blurred objects are ringed by in-between colours.
    min_crisp: float = 0.75


DEFAULT_PARAMS = CheckParams()


@dataclass(frozen=True)
class DetectedObject:
    colour: str
    shape: str  # one of SHAPES or UNKNOWN
    bbox: tuple[int, int, int, int]  # y0, x0, y1, x1 (exclusive ends)
    area: int


@dataclass(frozen=True)
class Verdict:
    """How an image matches a spec.

    With E the expected objects (multiset of (colour, shape)) and D the detected ones (every
    component above the speck size, its shape possibly "unknown"):

    - ``count_ok``: ``len(D) == len(E)``; all colours and shapes count.
    - ``colour_ok``: the *set* of colours in D equals the set in E: every asked colour is present
      and no other; how many of each is the count's business.
    - ``shape_ok``: the set of shapes in D equals the set in E; any "unknown" fails it.
    - ``strict``: D equals E as multisets of (colour, shape): right kinds, bound to the right
      colours, right numbers, nothing extra.
    - ``partial``: mean of the three sub-scores.

    For mixed scenes the sub-scores ignore binding: "a red circle and a green triangle" drawn as a
    red triangle and a green circle scores partial 1.0 and strict 0.0. Only ``strict`` checks it.
    """

    count_ok: bool
    colour_ok: bool
    shape_ok: bool
    strict: bool
    detected: tuple[DetectedObject, ...]

    @property
    def partial(self) -> float:
        return (self.count_ok + self.colour_ok + self.shape_ok) / 3.0


def check(image: np.ndarray, spec: SceneSpec, params: CheckParams = DEFAULT_PARAMS) -> Verdict:
    """Check a uint8 [3, H, W] image against ``spec``."""
    detected = detect(image, params)
    want = Counter((o.colour, o.shape) for o in spec.objects)
    got = Counter((d.colour, d.shape) for d in detected)
    return Verdict(
        count_ok=len(detected) == len(spec.objects),
        colour_ok={c for c, _ in got} == {c for c, _ in want},
        shape_ok={s for _, s in got} == {s for _, s in want},
        strict=got == want,
        detected=detected,
    )


def detect(image: np.ndarray, params: CheckParams = DEFAULT_PARAMS) -> tuple[DetectedObject, ...]:
    """Objects in a uint8 [3, H, W] image, ordered by colour then top-left position."""
    if image.ndim != 3 or image.shape[0] != 3 or image.dtype != np.uint8:
        raise ValueError(f"image must be uint8 [3, H, W], got {image.dtype} {image.shape}")
    labels = _colour_labels(image, params.colour_tol)
    h, w = labels.shape
    min_area = max(4, round(params.min_area_frac * h * w))
    objects = []
    for ci, colour in enumerate(COLOURS):
        for ys, xs in _components(labels == ci):
            if len(ys) < min_area:
                continue
            y0, y1, x0, x1 = int(ys.min()), int(ys.max()) + 1, int(xs.min()), int(xs.max()) + 1
            comp = np.zeros((h, w), dtype=bool)
            comp[ys, xs] = True
            shape = _classify(comp, labels, (y0, x0, y1, x1), params)
            objects.append(DetectedObject(colour, shape, (y0, x0, y1, x1), len(ys)))
    return tuple(objects)


def _colour_labels(image: np.ndarray, tol: float) -> np.ndarray:
    """[H, W] int: palette index, len(COLOURS) for background, -1 for neither."""
    palette = np.array([*COLOURS.values(), BACKGROUND], dtype=np.float32)  # [K, 3]
    pix = image.astype(np.float32).transpose(1, 2, 0)[..., None, :]  # [H, W, 1, 3]
    dist = np.sqrt(((pix - palette) ** 2).sum(-1))  # [H, W, K]
    nearest = dist.argmin(-1)
    return np.where(dist.min(-1) <= tol, nearest, -1)


def _components(mask: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """4-connected components of a boolean mask as (ys, xs) index arrays."""
    h, w = mask.shape
    todo = mask.copy()
    comps = []
    for start in zip(*np.nonzero(mask)):
        if not todo[start]:
            continue
        todo[start] = False
        stack, ys, xs = [start], [], []
        while stack:
            y, x = stack.pop()
            ys.append(y)
            xs.append(x)
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and todo[ny, nx]:
                    todo[ny, nx] = False
                    stack.append((ny, nx))
        comps.append((np.array(ys), np.array(xs)))
    return comps


def _classify(comp: np.ndarray, labels: np.ndarray, bbox: tuple[int, int, int, int], p: CheckParams) -> str:
    y0, x0, y1, x1 = bbox
    bh, bw = y1 - y0, x1 - x0
    if max(bh, bw) / min(bh, bw) > p.max_aspect or _crispness(comp, labels) < p.min_crisp:
        return UNKNOWN
    crop = comp[y0:y1, x0:x1]
    fill = float(crop.mean())
    for shape, lo, hi in p.fill_bands:
        if lo <= fill <= hi:
            return shape if _best_iou(crop, shape) >= p.min_iou else UNKNOWN
    return UNKNOWN


def _best_iou(crop: np.ndarray, shape: str) -> float:
    # Any of the four right-angle rotations counts: a triangle pointing sideways is a triangle.
    best = 0.0
    for k in range(4 if shape == "triangle" else 1):
        th, tw = crop.shape if k % 2 == 0 else crop.shape[::-1]
        tmpl = np.rot90(shape_mask(shape, th, tw), k)
        best = max(best, float((crop & tmpl).sum() / (crop | tmpl).sum()))
    return best


def _crispness(comp: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of the component's outer 4-neighbour ring that has a clean (labelled) colour."""
    grown = comp.copy()
    grown[1:] |= comp[:-1]
    grown[:-1] |= comp[1:]
    grown[:, 1:] |= comp[:, :-1]
    grown[:, :-1] |= comp[:, 1:]
    ring = grown & ~comp
    if not ring.any():  # the component fills the image
        return 1.0
    return float((labels[ring] >= 0).mean())


__all__ = ["DEFAULT_PARAMS", "UNKNOWN", "CheckParams", "DetectedObject", "Verdict", "check", "detect"]
