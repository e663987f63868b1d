"""A procedurally generated image dataset: CIFAR-shaped (3x32x32, 10 classes), nothing to download.

Each item is drawn in ``__getitem__`` from its own seed (the dataset's seed and the index), so any
process (a DataLoader worker, a rank on another node) makes the same image for the same index
without a file or a shared cache, and the data set costs no memory. The label is the shape: a
disk, a ring, a square, a square outline, a triangle, a plus, a cross, horizontal or vertical stripes,
or a checkerboard, at a random position, size (0.4-0.7 of the half-width), rotation (up to 20
degrees), colour and background gradient, with Gaussian pixel noise. Small shapes under the noise
are what makes it non-trivial: a disk from a square, stripes from a filled square at 11 pixels
across (docs/runtime.md, "The bundled example", has the accuracy a small ResNet reaches).
"""
from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset

SIZE = 32
CLASSES = ("disk", "ring", "square", "outline", "triangle", "plus", "cross", "hstripes", "vstripes",
           "checker")
NOISE = 0.12            # standard deviation of the pixel noise; pixel values are about 0-1 before it
MAX_TILT = math.radians(20)

# Pixel centres in [-1, 1], shared by every item of the process (read-only).
_AXIS = (torch.arange(SIZE, dtype=torch.float32) + 0.5) / SIZE * 2 - 1
_Y, _X = torch.meshgrid(_AXIS, _AXIS, indexing="ij")


def _mask(label: int, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Pixels of shape ``label`` in the shape's own coordinates (u, v), its extent about [-1, 1]."""
    box = torch.maximum(u.abs(), v.abs())
    if label == 0:
        return torch.hypot(u, v) <= 0.95
    if label == 1:
        r = torch.hypot(u, v)
        return (r <= 0.95) & (r >= 0.55)
    if label == 2:
        return box <= 0.85
    if label == 3:
        return (box <= 0.85) & (box >= 0.5)
    if label == 4:                          # apex up (v grows downwards, as image rows do)
        return (v <= 0.75) & (v >= 1.5 * u.abs() - 0.85)
    if label == 5:
        return ((u.abs() <= 0.28) | (v.abs() <= 0.28)) & (box <= 0.95)
    if label == 6:
        p, q = (u + v) * 0.7071, (u - v) * 0.7071
        return ((p.abs() <= 0.25) | (q.abs() <= 0.25)) & (torch.hypot(u, v) <= 1.0)
    if label == 7:
        return (box <= 0.85) & (torch.sin(v * 2.5 * math.pi) > 0)
    if label == 8:
        return (box <= 0.85) & (torch.sin(u * 2.5 * math.pi) > 0)
    return (box <= 0.85) & (torch.sin(u * 2.2 * math.pi) * torch.sin(v * 2.2 * math.pi) > 0)


def render(label: int, seed: int) -> torch.Tensor:
    """The 3x32x32 float image of shape ``label`` drawn from ``seed`` (deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    (size, cx, cy, tilt, slope, *colours) = torch.rand(14, generator=gen).tolist()
    scale = 0.4 + 0.3 * size
    cx, cy = (2 * cx - 1) * (1 - scale), (2 * cy - 1) * (1 - scale)    # the shape stays inside
    angle = (2 * tilt - 1) * MAX_TILT
    cos, sin = math.cos(angle), math.sin(angle)
    x, y = _X - cx, _Y - cy
    mask = _mask(label, (x * cos + y * sin) / scale, (y * cos - x * sin) / scale)
    # Background: a gradient between two nearby colours; the shape contrasts with it by at least
    # 0.35 per channel, lighter on a dark background and darker on a light one.
    bg = torch.tensor(colours[0:3]).view(3, 1, 1) * 0.6 + 0.2
    bg_far = bg + (torch.tensor(colours[3:6]).view(3, 1, 1) - 0.5) * 0.3
    sign = -1.0 if float(bg.mean()) > 0.5 else 1.0
    fg = (bg + sign * (0.35 + 0.3 * torch.tensor(colours[6:9]).view(3, 1, 1))).clamp(0, 1)
    along = 2 * slope - 1
    t = (_X * along + _Y * (1 - abs(along)) + 1) / 2
    image = torch.where(mask, fg, bg + (bg_far - bg) * t)
    return image + NOISE * torch.randn(3, SIZE, SIZE, generator=gen)


class Shapes(Dataset[tuple[torch.Tensor, int]]):
    """``n`` images; item ``i`` has label ``i % 10`` and is drawn from seed ``(seed, i)``. Train and
    test sets are two seeds (``Shapes(4096, seed=0)``, ``Shapes(2048, seed=1)``): no image is in
    both."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n = n
        self.seed = seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        label = index % len(CLASSES)
        return render(label, self.seed * 1_000_003 + index), label
