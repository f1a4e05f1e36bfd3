"""Generated CIFAR-sized images for the ResNet example: 3x32x32 float32, ``NUM_CLASSES`` classes.

Each class has a colour (a mean per channel) and a sinusoidal grating (a frequency and an orientation);
an image of class ``c`` is ``colour[c] + contrast * grating[c]`` at a random phase, with a random
brightness shift and N(0, ``noise``²) pixel noise. The colour alone separates the classes only
partly (colours are close), the grating tells them apart: a network must look at local structure
and pool it, which a small ResNet learns in a few hundred steps. The class parameters depend on
``seed`` only; the examples on ``seed`` and ``draw``, so splits drawn with different ``draw``s share
one distribution. Batches are drawn one at a time (``batches``), so a long run needs no big array.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

NUM_CLASSES = 10
SHAPE = (3, 32, 32)


def _class_params(seed: int, num_classes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(colours [C, 3], spatial frequencies [C] in cycles per image, orientations [C] in radians)."""
    rng = np.random.default_rng([seed, 0x5E5])
    colours = rng.normal(0.0, 0.35, size=(num_classes, 3))
    freqs = rng.permutation(np.linspace(2.0, 6.0, num_classes))
    angles = rng.permutation(np.linspace(0.0, np.pi, num_classes, endpoint=False))
    return colours, freqs, angles


def generate(num_examples: int, seed: int = 0, draw: int = 0, num_classes: int = NUM_CLASSES,
             contrast: float = 0.8, noise: float = 0.6) -> tuple[np.ndarray, np.ndarray]:
    """``(images float32 [n, 3, 32, 32], labels int64 [n, 1])``, deterministic from ``(seed, draw)``."""
    colours, freqs, angles = _class_params(seed, num_classes)
    rng = np.random.default_rng([seed, draw + 1])
    y = rng.integers(0, num_classes, size=num_examples)
    _, h, w = SHAPE
    rows, cols = np.meshgrid(np.arange(h) / h, np.arange(w) / w, indexing="ij")
    direction = np.cos(angles[y])[:, None, None] * rows + np.sin(angles[y])[:, None, None] * cols
    phase = rng.uniform(0.0, 2 * np.pi, size=(num_examples, 1, 1))
    grating = np.sin(2 * np.pi * freqs[y][:, None, None] * direction + phase)  # [n, h, w]
    brightness = rng.normal(0.0, 0.2, size=(num_examples, 1, 1, 1))
    x = (colours[y][:, :, None, None] + contrast * grating[:, None] + brightness
         + rng.normal(0.0, noise, size=(num_examples,) + SHAPE))
    return x.astype(np.float32), y.astype(np.int64).reshape(-1, 1)


def batches(batch_size: int, num_batches: int, seed: int = 0, draw: int = 0,
            num_classes: int = NUM_CLASSES) -> Iterator[dict[str, np.ndarray]]:
    """``num_batches`` feed dicts ``{"image", "label"}``; batch ``i`` is ``generate(batch_size, seed,
    draw=...)`` of its own draw, so every process sees the same stream and each batch is made only
    when it is reached."""
    for i in range(num_batches):
        x, y = generate(batch_size, seed=seed, draw=1_000_003 * (draw + 1) + i, num_classes=num_classes)
        yield {"image": x, "label": y}
