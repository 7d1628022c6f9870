"""The images to predict: every image file under a folder, recursively; no class folders needed.

Files are found by name (`is_image_name`: hidden files and non-image names are not images)
and checked cheaply (`check_file`: empty, not an image, truncated); bad ones are listed by name
in one warning and left out. A file that passes the check but still fails to decode in a
worker is not fatal either: its item comes back with a negative index (-1 - i), and the
prediction writer lists it and writes no row for it.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from torch.utils.data import Dataset

from datamodules.errors import DataError
from datamodules.sample.crop import ValCrop
from datamodules.sample.decode import decode
from datamodules.sample.images import check_file, is_image_name


def find_images(root: str | os.PathLike) -> tuple[list[str], list[tuple[str, str]]]:
    """(image paths relative to root, sorted; [(relative path, why)] for bad files)."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DataError(f"data.predict_dir {root} is not a folder.")
    good, bad = [], []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not is_image_name(name):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            why = check_file(os.path.join(dirpath, name))
            (bad.append((rel, why)) if why else good.append(rel))
    good.sort()
    bad.sort()
    if not good:
        raise DataError(f"data.predict_dir {root} holds no readable image files"
                        + (f" ({len(bad)} bad, e.g. {bad[0][0]}: {bad[0][1]})." if bad else "."))
    return good, bad


class PredictDataset(Dataset):
    """(uint8 CHW image at the validation size, dataset index); index -1 - i when file i cannot be decoded."""

    items_carry_index = True  # the prediction writer reads the index from the batch

    def __init__(self, root: str | os.PathLike, image_size: int, crop_ratio: float = 0.875) -> None:
        self.given_root = str(root)
        self.root = Path(root).expanduser().resolve()
        self.paths, self.bad_files = find_images(self.root)
        self.image_size = image_size
        self.crop = ValCrop(crop_ratio)  # validation's decode and crop: the same pixels as validate
        if self.bad_files:
            listed = "; ".join(f"{p} ({why})" for p, why in self.bad_files[:20])
            more = f"; ... and {len(self.bad_files) - 20} more" if len(self.bad_files) > 20 else ""
            warnings.warn(f"predict: skipping {len(self.bad_files)} bad file(s) under {self.root}: {listed}{more}",
                          stacklevel=2)

    def __len__(self) -> int:
        return len(self.paths)

    def path(self, i: int) -> str:
        return str(self.root / self.paths[i])

    def display_path(self, i: int) -> str:
        """The path as the user named the folder (predictions.csv's `path` column)."""
        return os.path.join(self.given_root, self.paths[i])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        try:
            with open(self.path(i), "rb") as f:
                return self.crop(decode(f.read()), self.image_size), i
        except Exception:  # noqa: BLE001 - a bad file is reported by the writer, the run goes on
            return torch.zeros(3, self.image_size, self.image_size, dtype=torch.uint8), -1 - i
