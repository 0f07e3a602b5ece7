"""Rule-based checker: does an image show what a shapes-world prompt asks for?

Pipeline: find the image's background (any uniform colour that is no palette colour: the
commonest such colour of its border); label each pixel with the palette colour or background it is
close to, or with nothing; take 4-connected components per colour; drop specks; classify each
component's shape. A component is an object whatever its shape; its shape is "unknown" unless it
passes every test (aspect ratio, fill ratio of its bounding box, match with an ideal template of
that shape and a clean edge), so blurry or irregular blobs earn no shape credit by chance.

It holds on scenes of other renderers (tests/shapes/independent_renderer.py: white, black, grey or
coloured backgrounds, palettes off by up to 30 per channel, 8-20 px shapes drawn by PIL).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from .scene import BACKGROUND, COLOURS, SceneSpec, shape_mask

UNKNOWN = "unknown"
_PALETTE = np.array(list(COLOURS.values()), dtype=np.float32)  # [C, 3]


@dataclass(frozen=True)
class CheckParams:
    # Max RGB distance to a palette colour or the background; palette colours are >= 170 apart, so
    # no pixel is close to two of them, and a palette off by 30 per channel (52) is still in.
    colour_tol: float = 70.0
    # Components smaller than this fraction of the image are specks (20 px at 32x32; the smallest
    # rendered object, a 10 px triangle, has 60, an 8 px equilateral one drawn by PIL 30).
    min_area_frac: float = 20 / 1024
    # Longer over shorter side of the bounding box; rendered objects have 1.0, equilateral
    # triangles up to 1.23.
    max_aspect: float = 1.3
    # Fill ratio (area / bounding-box area) bands; rendered values: circle 0.78-0.85, square 1.0,
    # triangle 0.56-0.63; drawn by PIL at 8-20 px: circle 0.75-0.81, triangle 0.50-0.56 (ideal
    # shapes: 0.785, 1, 0.5).
    fill_bands: tuple[tuple[str, float, float], ...] = (
        ("circle", 0.70, 0.90),
        ("square", 0.92, 1.00),
        ("triangle", 0.45, 0.68),
    )
    # Intersection over union with the shape's template stretched to the bounding box, ...
    min_iou: float = 0.85
    # ... or differences only on the template's boundary pixels, at most this many per inner
    # boundary pixel: PIL's 8-20 px shapes at any sub-pixel offset differ from the templates on up
    # to 0.36 (IoU down to 0.80 at 8 px); the shipped model's cut-corner triangles that fail the
    # overlap test on 0.42 and more, and stay unknown.
    max_edge_error: float = 0.4
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
    pixels = image.astype(np.float32).transpose(1, 2, 0)  # [H, W, 3]
    dist = _distances(pixels, np.vstack([_PALETTE, _background(pixels, tol)]))  # [H, W, C + 1]
    nearest = dist.argmin(-1)
    return np.where(dist.min(-1) <= tol, nearest, -1)


def _background(pixels: np.ndarray, tol: float) -> np.ndarray:
    """The image's background colour: the colour with the most border pixels near it, among the
    border pixels that are no palette colour (a renderer may choose any background but an object
    colour; objects may touch the border but not cover it). The world's BACKGROUND if none is."""
    border = np.concatenate([pixels[0], pixels[-1], pixels[1:-1, 0], pixels[1:-1, -1]])  # [P, 3]
    candidates = border[_distances(border, _PALETTE).min(-1) > tol]
    if not len(candidates):
        return np.array(BACKGROUND, dtype=np.float32)
    # Half the tolerance: a noisy background's pixels gather, an in-between edge colour stays apart.
    near = _distances(candidates, candidates) <= tol / 2  # [Q, Q]
    return candidates[near[near.sum(-1).argmax()]].mean(0)


def _distances(colours: np.ndarray, to: np.ndarray) -> np.ndarray:
    """RGB distance of every colour [..., 3] to each of `to` [K, 3]: [..., K]."""
    return np.sqrt(((colours[..., None, :] - to) ** 2).sum(-1))


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
            return shape if _fits_template(crop, shape, p) else UNKNOWN
    return UNKNOWN


def _fits_template(crop: np.ndarray, shape: str, p: CheckParams) -> bool:
    """Whether the component is the shape's template stretched to its box: an overlap of at least
    ``min_iou``, or the differences of two rasterisations of one shape (at 8-10 px these alone can
    cost more than 1 - min_iou)."""
    # Any of the four right-angle rotations counts: a triangle pointing sideways is a triangle.
    for k in range(4 if shape == "triangle" else 1):
        th, tw = crop.shape if k % 2 == 0 else crop.shape[::-1]
        tmpl = np.rot90(shape_mask(shape, th, tw), k)
        overlaps = (crop & tmpl).sum() >= p.min_iou * (crop | tmpl).sum()
        if overlaps or _rasterised_alike(crop, tmpl, p.max_edge_error):
            return True
    return False


def _rasterised_alike(crop: np.ndarray, tmpl: np.ndarray, max_share: float) -> bool:
    """Whether two masks of a box differ only as rasterisations of one shape do: on the template's
    boundary pixels (inside or out; beyond the box is out), on at most `max_share` of its inner ones."""
    padded = np.pad(tmpl, 1)
    inner = (padded & _grow(~padded))[1:-1, 1:-1]
    outer = (~padded & _grow(padded))[1:-1, 1:-1]
    differ = crop ^ tmpl
    return not (differ & ~inner & ~outer).any() and differ.sum() <= max_share * inner.sum()


def _grow(mask: np.ndarray) -> np.ndarray:
    """The mask and its 4-neighbours."""
    grown = mask.copy()
    grown[1:] |= mask[:-1]
    grown[:-1] |= mask[1:]
    grown[:, 1:] |= mask[:, :-1]
    grown[:, :-1] |= mask[:, 1:]
    return grown


def _crispness(comp: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of the component's outer 4-neighbour ring that has a clean (labelled) colour."""
    ring = _grow(comp) & ~comp
    if not ring.any():  # the component fills the image
        return 1.0
    return float((labels[ring] >= 0).mean())


__all__ = ["DEFAULT_PARAMS", "UNKNOWN", "CheckParams", "DetectedObject", "Verdict", "check", "detect"]
