"""The decoded images of a data set (:func:`edge_sdk.images.read_split_images`), cached: decoded once into
one ``.npz`` per source under :func:`cache_dir` (``$XDG_CACHE_HOME/oneshot-fl-edge/images``, or
``$ONESHOT_FL_EDGE_CACHE/images``), then each split read back from it alone.

A cache is keyed by the source (:func:`edge_sdk.images.source_key`: its path, size and modification time,
every listed file's for a folder), the resize, :data:`READER_VERSION` and Pillow's version, so a changed
source is decoded again and its stale cache removed. It holds nothing that cannot be decoded again: one
that is unreadable or malformed is rebuilt, one that cannot be written is skipped (with a warning).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zipfile
from pathlib import Path

import numpy as np
import PIL

from common.checks import check_int
from edge_sdk.images import SPLITS, ImageSet, read_split_images, source_key
from export.atomic import atomic_file

__all__ = ["CACHE_ENV", "READER_VERSION", "cache_dir", "load_split_images"]

logger = logging.getLogger(__name__)

# Bumped when the decoded pixels of an unchanged source would differ: older caches are then not reused.
READER_VERSION = 1
# Where the decoded caches go instead of $XDG_CACHE_HOME/oneshot-fl-edge (or ~/.cache/oneshot-fl-edge).
CACHE_ENV = "ONESHOT_FL_EDGE_CACHE"


def cache_dir() -> Path:
    """The folder of the decoded caches: ``$ONESHOT_FL_EDGE_CACHE/images`` when that is set, else
    ``$XDG_CACHE_HOME/oneshot-fl-edge/images`` (``~/.cache`` without it). Deleting it only costs a decode."""
    root = os.environ.get(CACHE_ENV, "").strip()
    if root:
        return Path(root).expanduser() / "images"
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "oneshot-fl-edge" / "images"


def load_split_images(source: Path, split: str, *, image_size: int | None = None) -> ImageSet:
    """One split of :func:`read_split_images` through the cache: both splits decoded once into one
    ``.npz`` under :func:`cache_dir` (its place is logged), then each read back from it alone while the
    source, resize and reader are unchanged."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if image_size is not None:
        image_size = check_int("image_size", image_size, 1)
    # Pillow's version too: another JPEG decoder may give other pixels for the same file
    inputs = {"source": source_key(source), "image_size": image_size, "reader": READER_VERSION}
    key = json.dumps(inputs | {"pillow": PIL.__version__}, sort_keys=True)
    # named by the source and size (a later decode of them replaces it), then by the whole key
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in source.resolve().name)[:48]
    where = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:12]
    stem = f"{slug}-{f's{image_size}' if image_size else 'full'}-{where}"
    path = cache_dir() / f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"
    cached = _read_cache(path, key, split)
    if cached is not None:
        logger.info("read %s decoded from the cache %s (delete it to decode again)", source, path)
        return cached
    logger.info("decoding %s once; the arrays go to the cache %s", source, path)
    splits = read_split_images(source, image_size=image_size)
    _write_cache(path, key, splits)
    for stale in path.parent.glob(f"{stem}-*.npz"):  # decodes of an earlier version of this source
        if stale != path:
            stale.unlink(missing_ok=True)
    return splits[split]


def _write_cache(path: Path, key: str, splits: dict[str, ImageSet]) -> None:
    arrays: dict[str, np.ndarray] = {"key": np.array(key)}
    for split, images in splits.items():
        arrays |= {f"x_{split}": images.x, f"y_{split}": images.y}
    first = splits[SPLITS[0]]
    arrays["num_classes"] = np.int64(first.num_classes)
    if first.class_names is not None:
        arrays["class_names"] = np.array(first.class_names, dtype=np.str_)
    try:
        with atomic_file(path) as fh:
            np.savez(fh, **arrays)
    except OSError as err:  # a read-only or full disk: the run goes on, the next one decodes again
        logger.warning(
            "could not write the cache %s (%s); the images will be decoded again next time", path, err
        )


def _read_cache(path: Path, key: str, split: str) -> ImageSet | None:
    """The ``split`` a cache file holds (its arrays alone read), or None when it is absent, of another key
    or unreadable (it is then written again: a cache holds nothing that cannot be decoded again)."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            if str(data["key"]) != key:
                return None
            names = tuple(str(n) for n in data["class_names"]) if "class_names" in data.files else None
            num_classes = int(data["num_classes"])
            x, y = data[f"x_{split}"], data[f"y_{split}"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
        logger.warning("the cache %s is unreadable (%s); decoding again", path, err)
        return None
    if x.dtype != np.uint8 or x.ndim != 4 or y.dtype != np.int64 or y.shape != (len(x),):
        logger.warning("the cache %s holds malformed %s arrays; decoding again", path, split)
        return None
    return ImageSet(x, y, num_classes, names)
