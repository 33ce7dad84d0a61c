"""CIFAR-10 / CIFAR-100 through torchvision, and the CIFAR training augmentation.

Legend: B batch, C channels, H x W pixels, N images.

torchvision's CIFAR classes check the md5 of every batch file and unpickle them; we only take
their uint8 arrays and normalise ourselves (build.py) so that all data sets come out the same way.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..errors import DataError

# name -> (torchvision class name, folder under ROOT, expected files, title)
_CIFAR = {
    "cifar10": ("CIFAR10", "cifar-10-batches-py",
                "data_batch_1..data_batch_5, test_batch, batches.meta", "CIFAR-10"),
    "cifar100": ("CIFAR100", "cifar-100-python", "train, test, meta", "CIFAR-100"),
}
# Per-channel mean and std of the training images (pixels in [0, 1]).
STATS = {"cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
         "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))}
NUM_CLASSES = {"cifar10": 10, "cifar100": 100}


def load(root: str, name: str, download: bool = False):
    """``ROOT/cifar-10-batches-py`` (or ``cifar-100-python``) -> (train, test), each
    ``(images_NCHW uint8, labels_N int64)``. torchvision needs both splits present."""
    import torchvision  # late: synthetic and MNIST runs need not pay for the import

    cls_name, base, files, title = _CIFAR[name]
    cls = getattr(torchvision.datasets, cls_name)
    folder = os.path.join(root, base)
    out = []
    for train in (True, False):
        try:
            dataset = cls(root, train=train, download=download)
        except RuntimeError:  # torchvision: "Dataset not found or corrupted"
            raise DataError(f"{folder}: {title} not found or corrupted (expected {files}, md5-checked "
                            f"by torchvision); set data.root or FEDDDP_DATA to the folder that holds "
                            f"{base}, or data.download=true (needs internet)") from None
        except OSError as exc:  # a download that failed (URLError is an OSError)
            raise DataError(f"{folder}: download of {title} failed ({exc}); fetch it by hand "
                            "or check the internet connection") from None
        # torchvision stores NCHW data transposed to NHWC; transposing back is contiguous again.
        images_NCHW = np.ascontiguousarray(dataset.data.transpose(0, 3, 1, 2))
        out.append((images_NCHW, np.asarray(dataset.targets, dtype=np.int64)))
    return out[0], out[1]


def augment_batch(x_BCHW: torch.Tensor, generator: torch.Generator, pad: int = 4,
                  hole: int = 16) -> torch.Tensor:
    """Random crop (zero padding ``pad``), horizontal flip with probability 1/2, and cutout (one
    ``hole`` x ``hole`` square of zeros, centre anywhere in the image, clipped at the borders;
    DeVries & Taylor 2017), for a normalised batch. All draws come from ``generator``, so a
    client's augmentation is reproducible. Zero is the data-set mean colour after normalisation,
    so padding and holes are filled with the mean (torchvision pads before normalising, with
    black); the difference is immaterial for training and keeps this free of data-set stats."""
    B, C, H, W = x_BCHW.shape
    gen_device = generator.device

    def randint(high: int) -> torch.Tensor:
        return torch.randint(0, high, (B,), generator=generator, device=gen_device).to(x_BCHW.device)

    top_B, left_B = randint(2 * pad + 1), randint(2 * pad + 1)
    flip_B = randint(2).bool()
    centre_y_B, centre_x_B = randint(H), randint(W)

    # Crop: gather rows top..top+H and columns left..left+W of the padded images in one indexing op.
    padded = torch.nn.functional.pad(x_BCHW, (pad, pad, pad, pad))
    rows_BH = top_B[:, None] + torch.arange(H, device=x_BCHW.device)
    cols_BW = left_B[:, None] + torch.arange(W, device=x_BCHW.device)
    cols_BW = torch.where(flip_B[:, None], cols_BW.flip(1), cols_BW)  # flip = read columns backwards
    batch_B = torch.arange(B, device=x_BCHW.device)
    out_BHWC = padded.permute(0, 2, 3, 1)[batch_B[:, None, None], rows_BH[:, :, None], cols_BW[:, None, :]]
    out_BCHW = out_BHWC.permute(0, 3, 1, 2)

    # Cutout: rows [cy - hole/2, cy + hole/2) x cols [cx - hole/2, cx + hole/2), clipped by the image.
    ys_H = torch.arange(H, device=x_BCHW.device)
    xs_W = torch.arange(W, device=x_BCHW.device)
    in_rows_BH = (ys_H >= centre_y_B[:, None] - hole // 2) & (ys_H < centre_y_B[:, None] + hole // 2)
    in_cols_BW = (xs_W >= centre_x_B[:, None] - hole // 2) & (xs_W < centre_x_B[:, None] + hole // 2)
    hole_B1HW = (in_rows_BH[:, :, None] & in_cols_BW[:, None, :])[:, None]
    return out_BCHW.masked_fill(hole_B1HW, 0.0).contiguous()
