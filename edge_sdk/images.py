"""Image files as uint8 arrays: a client's image folder, a data set's train/test folder or ``.tar.gz``
(a user's photos, CIFAR-10's JPEG copy). :mod:`edge_sdk.image_cache` decodes such a data set once.

Layouts: a client's folder is ``<class>/<image>``; a data set is ``[<top>/]train/<class>/<image>`` and
``[<top>/]test/<class>/<image>``, as a folder or a ``.tar.gz`` read member by member (nothing unpacked
to disk). Both readers list the same files (hidden names, other suffixes and sub-folders of a class
folder skipped) and order them by split, class and file name, so a folder and its archive give
identical arrays. Class folders with integer names are class indices, other names are sorted.

Every file is untrusted: the image count, each file's bytes and each image's width x height (from its
header, before any pixel is decoded) are bounded; an archive's links, absolute or parent paths and
special files are refused. A file that cannot be read is one :class:`DataError` naming it. Pixel modes
are converted where that is well defined (palette, alpha, CMYK, ... -> RGB; 1-bit, grey with alpha and
16-bit grey -> 8-bit grey); the set is grey only when every image is.
"""

from __future__ import annotations

import hashlib
import io
import logging
import tarfile
import warnings
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from common.errors import DataError

__all__ = [
    "IMAGE_SUFFIXES",
    "MAX_FILE_BYTES",
    "MAX_IMAGES",
    "MAX_IMAGE_PIXELS",
    "SPLITS",
    "ImageSet",
    "decode_image",
    "read_image_folder",
    "read_split_images",
    "source_key",
]

logger = logging.getLogger(__name__)

SPLITS = ("train", "test")
IMAGE_SUFFIXES = frozenset(
    {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm", ".ppm"}
)
# Bounds on what a folder or archive may make this process decode and hold.
MAX_IMAGES = 2_000_000  # images in one data set
MAX_IMAGE_PIXELS = 50_000_000  # width x height of one image, read from its header before decoding
MAX_FILE_BYTES = 64 * 2**20  # one image file or archive member
MAX_ARCHIVE_BYTES = 32 * 2**30  # all members of an archive together (a gzip bomb stops here)
MAX_DATASET_BYTES = 16 * 2**30  # the decoded arrays of one data set (counted as 3 channels)
_EMPTY = np.empty(0, dtype=np.uint8)
GREY = frozenset({"1", "L", "LA", "La"})
SIXTEEN_BIT_GREY = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})
COLOUR = frozenset({"RGB", "RGBA", "RGBX", "RGBa", "CMYK", "YCbCr", "LAB", "HSV", "P", "PA"})


@dataclass(frozen=True, eq=False)
class ImageSet:
    """Decoded images: ``x`` uint8 ``N x C x H x W`` (C 1 or 3), ``y`` int64 labels, the class count and
    the classes' names (None where the class folders are integer indices)."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    class_names: tuple[str, ...] | None


@dataclass(frozen=True)
class _Item:
    """One image file to decode: its split (index), class folder and file name (what it sorts by), what
    it is called in messages, and how to get its bytes (a path, or the bytes an archive held)."""

    split: int
    folder: str
    name: str
    where: str
    source: Path | bytes


# --- one image ----------------------------------------------------------------------------------------


def decode_image(source: Path | bytes, where: str, *, image_size: int | None = None) -> np.ndarray:
    """One image file as uint8 pixels, ``H x W`` (grey) or ``H x W x 3`` (colour); with ``image_size``,
    scaled and centre-cropped to ``image_size`` square. ``where`` names the file in errors."""
    fix = "fix: replace or delete the file"
    size = -1
    try:
        size = len(source) if isinstance(source, bytes) else source.stat().st_size
        if size > MAX_FILE_BYTES:
            raise DataError(f"image {where} is {size} bytes, more than {MAX_FILE_BYTES}; {fix}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow's palette-transparency and bomb warnings: checked here
            with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as img:
                width, height = img.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise DataError(
                        f"image {where} is {width}x{height}, more than {MAX_IMAGE_PIXELS} pixels; "
                        "fix: scale it down before use"
                    )
                if image_size is not None:
                    img.draft(None, (image_size, image_size))  # JPEG: decode at a reduced scale (>= size)
                img.load()
                img = _eight_bit(img, where)
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as err:
        if isinstance(err, DataError):
            raise
        what = "not an image" if isinstance(err, UnidentifiedImageError) else str(err) or type(err).__name__
        raise DataError(
            f"cannot read image {where}{' (0 bytes)' if size == 0 else ''}: {what}; {fix}"
        ) from err
    if image_size is not None and img.size != (image_size, image_size):
        img = ImageOps.fit(img, (image_size, image_size), method=Image.Resampling.BICUBIC)
    return np.asarray(img, dtype=np.uint8)


def _eight_bit(img: Image.Image, where: str) -> Image.Image:
    """``img`` upright (its EXIF orientation applied) as 8-bit ``L`` or ``RGB``."""
    # older Pillow versions open a 16-bit grey PNG as 32-bit "I" holding the same 0..65535
    sixteen_bit = img.mode in SIXTEEN_BIT_GREY or (img.mode == "I" and img.format == "PNG")
    if img.getexif().get(0x0112, 1) != 1:
        img = ImageOps.exif_transpose(img)
    if img.mode in ("L", "RGB"):
        return img
    if img.mode in GREY:
        return img.convert("L")
    if sixteen_bit:  # 0..65535 -> 0..255, rounded
        wide = np.asarray(img).astype(np.uint32)
        return Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8))
    if img.mode in ("P", "PA") and "transparency" in img.info:
        return img.convert("RGBA").convert("RGB")
    if img.mode in COLOUR:
        return img.convert("RGB")
    raise DataError(
        f"image {where} has pixel mode {img.mode!r}, which has no fixed 0-255 range; "
        "fix: save it as 8-bit (or 16-bit) greyscale or RGB"
    )


# --- many images ---------------------------------------------------------------------------------------


def _decode_all(items: Iterable[_Item], image_size: int | None) -> tuple[list[_Item], np.ndarray]:
    """Decode ``items`` (bounded in count and bytes as they come) into one ``N x C x H x W`` array, in
    their order. One size unless resized; grey only if every image is."""
    done: list[_Item] = []
    decoded: list[np.ndarray] = []
    shape: tuple[int, int] | None = None
    total = 0
    for item in items:
        if len(done) >= MAX_IMAGES:
            raise DataError(f"more than {MAX_IMAGES} images at {item.where}; use a smaller data set")
        pixels = decode_image(item.source, item.where, image_size=image_size)
        height, width = pixels.shape[:2]
        if shape is None:
            shape = (height, width)
        elif (height, width) != shape:
            raise DataError(
                f"image {item.where} is {width}x{height}, others are {shape[1]}x{shape[0]}; "
                "fix: give an image size (--image-size) to resize every image to it"
            )
        total += 3 * height * width
        if total > MAX_DATASET_BYTES:
            raise DataError(
                f"the decoded images pass {MAX_DATASET_BYTES} bytes at {item.where}; "
                "fix: give a smaller image size (--image-size) or use fewer images"
            )
        done.append(replace(item, source=b"") if isinstance(item.source, bytes) else item)  # bytes freed
        decoded.append(pixels)
    channels = 3 if any(p.ndim == 3 for p in decoded) else 1
    height, width = shape or (0, 0)
    # each image dropped once copied: the pages of ``x`` are committed as it fills, so the peak stays near
    # one copy of the data set instead of two
    x = np.empty((len(decoded), channels, height, width), dtype=np.uint8)
    for i, pixels in enumerate(decoded):
        # a grey image in a colour set: its value in every channel (what Pillow's L -> RGB does)
        x[i] = pixels.transpose(2, 0, 1) if pixels.ndim == 3 else pixels[None]
        decoded[i] = _EMPTY
    return done, x


def _ordered(
    items: list[_Item], x: np.ndarray, labels: dict[str, int]
) -> tuple[list[_Item], np.ndarray, np.ndarray]:
    """Items, images and labels in the order of (split, label, file name): the same for a folder and its
    archive, whatever order the archive stores its members in."""
    y = np.array([labels[item.folder] for item in items], dtype=np.int64)
    splits = np.array([item.split for item in items], dtype=np.int64)
    perm = np.lexsort((np.array([item.name for item in items], dtype=np.str_), y, splits))
    if np.array_equal(perm, np.arange(len(items))):
        return items, x, y
    return [items[i] for i in perm], x[perm], y[perm]


def _labels(names: Iterable[str], where: str) -> tuple[dict[str, int], int, tuple[str, ...] | None]:
    """Label of each class folder, the class count and the class names (None for integer names)."""
    names = sorted(set(names))
    if not names:
        raise DataError(f"{where} has no class sub-folders; {_LAYOUT}")
    if all(n.isdigit() for n in names):
        labels = {n: int(n) for n in names}
        return labels, max(labels.values()) + 1, None
    return {n: i for i, n in enumerate(names)}, len(names), tuple(names)


_LAYOUT = "expected one sub-folder per class holding its images (e.g. cat/1.png, dog/2.jpg)"
_SPLIT_LAYOUT = "expected train/<class>/<image> and test/<class>/<image> (one sub-folder per class)"


def _is_image(name: str) -> bool:
    return not name.startswith(".") and PurePosixPath(name).suffix.lower() in IMAGE_SUFFIXES


def _class_folders(folder: Path) -> list[Path]:
    """The class sub-folders of ``folder``, refusing images beside them."""
    entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    stray = [p.name for p in entries if p.is_file() and _is_image(p.name)]
    if stray:
        raise DataError(f"image folder {folder} has images outside class folders ({stray[:3]}); {_LAYOUT}")
    return [p for p in entries if p.is_dir()]


def _image_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if _is_image(f.name) and f.is_file())


def read_image_folder(root: Path, *, image_size: int | None = None) -> ImageSet:
    """A client's image folder: one sub-folder per class (see the module docstring)."""
    folders = _class_folders(root)
    labels, num_classes, names = _labels((p.name for p in folders), f"image folder {root}")
    files = [f for p in folders for f in _image_files(p)]
    if not files:
        raise DataError(f"image folder {root} holds no images ({sorted(IMAGE_SUFFIXES)}); {_LAYOUT}")
    if len(files) > MAX_IMAGES:
        raise DataError(f"image folder {root} holds {len(files)} images, more than {MAX_IMAGES}")
    items, x = _decode_all((_Item(0, f.parent.name, f.name, str(f), f) for f in files), image_size)
    _, x, y = _ordered(items, x, labels)
    return ImageSet(x, y, num_classes, names)


# --- a data set: train/ and test/, from a folder or an archive ------------------------------------------


def _folder_listing(root: Path) -> tuple[dict[str, list[str]], list[tuple[str, str, Path]]]:
    """The class folders of each split and every image file (split, class, path) of a data-set folder."""
    missing = [s for s in SPLITS if not (root / s).is_dir()]
    if missing:
        raise DataError(
            f"data folder {root} has no {' and no '.join(m + '/' for m in missing)}; {_SPLIT_LAYOUT}"
        )
    classes: dict[str, list[str]] = {}
    files: list[tuple[str, str, Path]] = []
    for split in SPLITS:
        folders = _class_folders(root / split)
        classes[split] = [p.name for p in folders]
        files += [(split, p.name, f) for p in folders for f in _image_files(p)]
        if len(files) > MAX_IMAGES:
            raise DataError(f"data folder {root} holds more than {MAX_IMAGES} images; use a smaller data set")
    return classes, files


def _check_classes(classes: dict[str, list[str]], where: str) -> tuple[dict[str, int], int, tuple | None]:
    train, test = sorted(set(classes.get("train", ()))), sorted(set(classes.get("test", ())))
    if train != test:
        only_train, only_test = sorted(set(train) - set(test)), sorted(set(test) - set(train))
        raise DataError(
            f"{where}: the class folders of train/ and test/ differ (only in train: {only_train[:5]}, "
            f"only in test: {only_test[:5]}); fix: give both splits the same class folders"
        )
    return _labels(train, where)


def _archive_members(path: Path) -> Iterator[tuple[tuple[str, ...], bool, bytes | None]]:
    """(path parts, is a directory, bytes) of each member of a ``.tar.gz`` in archive order (bytes None
    for a directory, a hidden file or one that is no image), after refusing links, absolute or parent
    paths, special files and members past the size bounds."""
    total = 0
    with tarfile.open(path, mode="r|gz") as tar:
        for member in tar:
            parts = PurePosixPath(member.name).parts
            bad = (
                "a link" if member.issym() or member.islnk()
                else "an absolute or parent path" if member.name.startswith("/") or ".." in parts
                else "a special file" if not (member.isreg() or member.isdir())
                else None
            )  # fmt: skip
            if bad:
                raise DataError(f"archive {path}: member {member.name!r} is {bad}; fix: repack it without")
            if member.isdir() or not _is_image(parts[-1]) or any(p.startswith(".") for p in parts):
                yield parts, member.isdir(), None
                continue
            if member.size > MAX_FILE_BYTES:
                raise DataError(f"archive {path}: member {member.name} is {member.size} bytes, more than "
                                f"{MAX_FILE_BYTES}; fix: repack it without")  # fmt: skip
            total += member.size
            if total > MAX_ARCHIVE_BYTES:
                raise DataError(f"archive {path} unpacks to more than {MAX_ARCHIVE_BYTES} bytes")
            handle = tar.extractfile(member)
            yield parts, False, handle.read() if handle is not None else b""


def _archive_items(path: Path, classes: dict[str, list[str]]) -> Iterator[tuple[str, str, str, bytes]]:
    """(split, class, file name, bytes) of each image of a data-set archive; fills ``classes`` (the class
    folders seen in each split) as it goes. An optional single top folder holds train/ and test/."""
    tops: set[str] = set()
    seen: set[tuple[str, ...]] = set()
    for parts, is_dir, data in _archive_members(path):
        rest = parts if parts and parts[0] in SPLITS else parts[1:]
        if not rest or rest[0] not in SPLITS:
            continue  # outside the splits (a README beside them)
        tops.add("" if rest is parts else parts[0])
        if len(tops) > 1:
            raise DataError(f"archive {path} holds splits under several top folders {sorted(tops)}; "
                            f"{_SPLIT_LAYOUT}")  # fmt: skip
        if len(rest) == 2 and data is not None:
            raise DataError(
                f"archive {path}: image {'/'.join(parts)} is outside class folders; {_SPLIT_LAYOUT}"
            )
        if (len(rest) > 2 or is_dir) and len(rest) > 1 and not rest[1].startswith("."):  # a class folder
            classes.setdefault(rest[0], [])
            if rest[1] not in classes[rest[0]]:
                classes[rest[0]].append(rest[1])
        if len(rest) != 3 or data is None:
            continue  # a folder, a file that is no image, or below a class folder (a folder skips those)
        if rest in seen:
            raise DataError(f"archive {path} holds {'/'.join(parts)} twice; fix: repack it")
        seen.add(rest)
        yield rest[0], rest[1], rest[2], data


def read_split_images(source: Path, *, image_size: int | None = None) -> dict[str, ImageSet]:
    """The train and test splits of a data-set folder or ``.tar.gz`` (see the module docstring)."""
    classes: dict[str, list[str]] = {}
    try:
        if source.is_dir():
            classes, files = _folder_listing(source)
            labels, num_classes, names = _check_classes(classes, f"data folder {source}")
            items = (_Item(SPLITS.index(s), c, f.name, str(f), f) for s, c, f in files)
        else:  # the labels are known once every class folder is seen: after the decode
            raw = _archive_items(source, classes)
            items = (_Item(SPLITS.index(s), c, n, f"{source}:{s}/{c}/{n}", d) for s, c, n, d in raw)
        done, x = _decode_all(items, image_size)
        if not source.is_dir():
            labels, num_classes, names = _check_classes(classes, f"archive {source}")
    except (tarfile.TarError, zlib.error, EOFError, OSError) as err:
        raise DataError(
            f"cannot read {source} ({err}); expected a folder or a .tar.gz; {_SPLIT_LAYOUT}"
        ) from err
    done, x, y = _ordered(done, x, labels)
    splits = {}
    for index, split in enumerate(SPLITS):
        rows = np.flatnonzero(np.array([item.split == index for item in done], dtype=bool))
        if not len(rows):
            raise DataError(f"{source}: the {split} split holds no images; {_SPLIT_LAYOUT}")
        part = slice(int(rows[0]), int(rows[-1]) + 1)  # contiguous: the items are ordered by split first
        splits[split] = ImageSet(np.ascontiguousarray(x[part]), y[part], num_classes, names)
    return splits


def source_key(source: Path) -> dict[str, Any]:
    """What a data set's decoded images are a function of, as far as its files go: the path, and the
    size and modification time of the archive or of every image file of the folder."""
    path = source.resolve()
    if not path.is_dir():
        stat = path.stat()
        return {"path": str(path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    _, files = _folder_listing(path)
    digest = hashlib.sha256()
    for _, _, f in files:
        stat = f.stat()
        digest.update(f"{f.relative_to(path).as_posix()}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    return {"path": str(path), "files": len(files), "listing_sha256": digest.hexdigest()}
