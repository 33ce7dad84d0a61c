"""Colored MNIST of FedGMA (Tenison et al., seed 001, section 4 and appendix A.2), drawn on the
MNIST digits: colour is a feature that predicts the label in training and not in the
out-of-distribution (OOD) test set, which is the global test set here.

binary (``data.colored_variant = "binary"``, after Arjovsky et al. 2019): label 0 for digits
< 5, 1 for the rest (the paper's Fig. 3); strokes red for label 0 and green for label 1 on black,
except that client k shows the other colour with its own probability p_k. The p_k are spread
evenly over [``colored_flip_min``, ``colored_flip_max``] (0.1-0.2) and dealt to clients by a
permutation seeded by ``data.seed``. OOD test: the colour is reversed with probability
``colored_test_flip`` (0.9). No label noise: the paper adds none (Arjovsky et al. flip 25%).

multiclass (after Arpit et al. 2019): label = digit; class c owns two foreground and two
background colours that no other class uses, and each training image takes one of each at
random. OOD test: foreground and background drawn at random from 10 further colours, the
foreground never equal to the background (the digit would vanish).

Images are RGB [3, H, W], pixel = fg * g + bg * (1 - g) with g the grey level in [0, 1], not
standardised (the test colours differ from the training ones by design, so training statistics
would not centre them). Every draw for client k comes from a generator seeded by (seed, k) and
runs over that client's samples in index order, so its tensors are bitwise the same on
whichever rank builds them.

Legend: N images, H x W pixels, K clients, C classes.
"""

from __future__ import annotations

import numpy as np
import torch

from .clients import ClientData, FederatedData

_CLIENT_STREAM = 0x434D_0001  # domain tags of the generator streams (see synthetic.py)
_TEST_STREAM = 0x434D_0002
_FLIP_STREAM = 0x434D_0003
RED, GREEN = (1.0, 0.0, 0.0), (0.0, 1.0, 0.0)


def _palettes() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(foreground [10, 2, 3], background [10, 2, 3], OOD test [10, 3]): 50 distinct RGB colours,
    fixed (part of the data set, not of a run). Foregrounds are bright and backgrounds dark so
    that every training pair keeps the digit visible; hues are spread round the colour wheel."""
    def hsv(h, s, v):  # h in [0, 1): a standard HSV -> RGB conversion, vectorised over h
        i = np.floor(h * 6).astype(int) % 6
        f = h * 6 - np.floor(h * 6)
        p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
        table = np.stack([np.stack(c, -1) for c in ((v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q))])
        return table[i, np.arange(len(h))].astype(np.float32)

    one = np.ones(20)
    hues_20 = np.arange(20) / 20
    fg = hsv(hues_20, 0.9 * one, 1.0 * one).reshape(2, 10, 3).transpose(1, 0, 2)   # class c: hues c/20, (c+10)/20
    bg = hsv((hues_20 + 1 / 40) % 1, 0.8 * one, 0.35 * one).reshape(2, 10, 3).transpose(1, 0, 2)
    test = hsv((np.arange(10) + 0.5) / 10, 0.5 * one[:10], 0.7 * one[:10])  # mid saturation and value
    return np.ascontiguousarray(fg), np.ascontiguousarray(bg), test


FOREGROUND_C23, BACKGROUND_C23, TEST_COLOURS_103 = _palettes()


def render(images_N1HW: np.ndarray, fg_N3: np.ndarray, bg_N3: np.ndarray) -> torch.Tensor:
    """uint8 grey digits -> float32 RGB [N, 3, H, W] = fg * g + bg * (1 - g)."""
    g_N1HW = images_N1HW.astype(np.float32) / np.float32(255.0)
    out_N3HW = fg_N3[:, :, None, None] * g_N1HW + bg_N3[:, :, None, None] * (np.float32(1.0) - g_N1HW)
    return torch.from_numpy(np.ascontiguousarray(out_N3HW, dtype=np.float32))


def flip_probabilities(num_clients: int, low: float, high: float, seed: int) -> np.ndarray:
    """p_K: ``num_clients`` values evenly spread over [low, high], dealt out by a seeded permutation
    (every rank computes all of them; with two clients they are IRM's 0.1 and 0.2)."""
    spread_K = np.linspace(low, high, num_clients)
    return spread_K[np.random.default_rng([_FLIP_STREAM, seed]).permutation(num_clients)]


def binary_labels(digits_N: np.ndarray) -> np.ndarray:
    return (digits_N >= 5).astype(np.int64)


def colour_binary(images_N1HW, digits_N, flip_probability: float, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """Red for label 0, green for label 1, each colour swapped with ``flip_probability``."""
    labels_N = binary_labels(digits_N)
    green_N = labels_N.astype(bool) ^ (rng.random(len(labels_N)) < flip_probability)
    fg_N3 = np.where(green_N[:, None], np.float32(GREEN), np.float32(RED)).astype(np.float32)
    return render(images_N1HW, fg_N3, np.zeros_like(fg_N3)), torch.from_numpy(labels_N)


def colour_multiclass_train(images_N1HW, digits_N, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """One of the class's two foregrounds and one of its two backgrounds, at random."""
    fg_pick_N, bg_pick_N = rng.integers(0, 2, len(digits_N)), rng.integers(0, 2, len(digits_N))
    return (render(images_N1HW, FOREGROUND_C23[digits_N, fg_pick_N], BACKGROUND_C23[digits_N, bg_pick_N]),
            torch.from_numpy(digits_N.astype(np.int64)))


def colour_multiclass_test(images_N1HW, digits_N, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """Background and (a different) foreground from the 10 test colours, independent of the class."""
    bg_N = rng.integers(0, 10, len(digits_N))
    fg_N = (bg_N + rng.integers(1, 10, len(digits_N))) % 10
    return (render(images_N1HW, TEST_COLOURS_103[fg_N], TEST_COLOURS_103[bg_N]),
            torch.from_numpy(digits_N.astype(np.int64)))


def build(data_cfg, seed: int, train, test, parts: list[np.ndarray], owned_ids: list[int]) -> FederatedData:
    """MNIST splits ``(images_N1HW uint8, digits_N)`` and the partition (made from the digits, so
    non-IID means digits per client) -> coloured clients (owned only) and the OOD test set."""
    images_N1HW, digits_N = train
    binary = data_cfg.colored_variant == "binary"
    flip_K = flip_probabilities(data_cfg.num_clients, data_cfg.colored_flip_min, data_cfg.colored_flip_max,
                                seed)
    clients = {}
    for k in sorted(owned_ids):
        rng = np.random.default_rng([_CLIENT_STREAM, seed, k])
        x_N, d_N = images_N1HW[parts[k]], digits_N[parts[k]]
        clients[k] = ClientData(*(colour_binary(x_N, d_N, flip_K[k], rng) if binary
                                  else colour_multiclass_train(x_N, d_N, rng)))
    rng = np.random.default_rng([_TEST_STREAM, seed])
    test_x, test_y = (colour_binary(*test, data_cfg.colored_test_flip, rng) if binary
                      else colour_multiclass_test(*test, rng))
    return FederatedData(num_classes=2 if binary else 10, input_shape=(3, *images_N1HW.shape[2:]),
                         num_samples=[len(p) for p in parts], train=clients, test=ClientData(test_x, test_y))
