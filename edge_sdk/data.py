"""Datasets, the Dirichlet label-skew partition, and client data files.

Everything is held as tensors in memory: uint8 ``N x C x H x W`` images and int64 labels
(:class:`ArrayDataset`). The benchmark datasets are small enough for that, training then indexes tensors
instead of decoding one PIL image per sample, and a client's whole data set is one ``.npz`` file.

Datasets: ``mnist``, ``fashionmnist``, ``cifar10`` and ``svhn`` are read through torchvision from a
torchvision-layout root (nothing is downloaded unless asked); ``cifar10`` also from its JPEG copy
(``cifar10-jpeg.tar.gz`` or its unpacked ``cifar10-jpeg/`` in the root); ``folder`` is a user's own
images, a folder (or ``.tar.gz``) with ``train/<class>/`` and ``test/<class>/``, resized to
``image_size`` when given. Image files are decoded by :mod:`edge_sdk.images`, once
(:mod:`edge_sdk.image_cache`): later loads read the cache. ``digits`` is scikit-learn's bundled 8x8
digits, which needs no files at all (tests and quick runs use it).
"""

from __future__ import annotations

import hashlib
import io
import math
import pickle
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.checks import check_int
from common.errors import ConfigError, DataError
from edge_sdk.image_cache import load_split_images
from edge_sdk.images import ImageSet, read_image_folder, source_key
from export.atomic import atomic_write_bytes, atomic_write_json
from export.metadata import UNKNOWN_CLASS, InputSpec, check_class_names, deploy_metadata, index_class_names
from export.onnx_export import INPUT_NAME

__all__ = [
    "CLASS_NAMES",
    "DATASETS",
    "DIGITS_SPLIT_SEED",
    "DIGITS_TEST_FRACTION",
    "PIXEL_MEAN",
    "PIXEL_STD",
    "SCHEME",
    "ArrayDataset",
    "PartitionResult",
    "check_image_size",
    "client_datasets",
    "client_name",
    "data_sha256",
    "dataset_source",
    "deploy_metadata_for",
    "dirichlet_partition",
    "load_client_data",
    "load_dataset",
    "partition",
    "partition_settings",
    "save_client_data",
    "split_sizes",
    "split_train_val",
]

DATASETS: tuple[str, ...] = ("mnist", "fashionmnist", "cifar10", "svhn", "digits", "folder")
SPLITS = ("train", "test")
# scikit-learn's digits has no official split: a stratified 75/25 split with this fixed seed stands in.
DIGITS_TEST_FRACTION = 0.25
DIGITS_SPLIT_SEED = 0
# Models take float32 pixels in [0, 1] (``x.float() / 255``) and normalise inside, as (x - mean) / std, so
# an exported ONNX model needs no preprocessing beyond that division. Every architecture family uses these.
PIXEL_MEAN = 0.5
PIXEL_STD = 0.5
# Class names, one per label in label order, of each named dataset (torchvision's ``classes``; SVHN's labels
# are its digits, "0" stored as label 0; a folder's are its class folders'). They travel with the data
# (client files) into every exported model.
CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "digits": index_class_names(10),
    "mnist": index_class_names(10),
    "svhn": index_class_names(10),
    "fashionmnist": (
        "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
        "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
    ),
    "cifar10": (
        "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
    ),
}  # fmt: skip
SCHEME = (
    "dirichlet-label-skew (FedDF / NIID-bench: per-class Dir(alpha) over clients, cap N/K, min-size retry)"
)
# CIFAR-10's JPEG copy in a data root (image-folder layout, see edge_sdk.images), beside or instead of
# torchvision's cifar-10-batches-py/, which is read first where present (the original pixels)
CIFAR10_JPEG = "cifar10-jpeg"


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """A labelled image set held as tensors: ``x`` uint8 ``N x C x H x W``, ``y`` int64 ``N``, and the
    classes' names when known (one per class, what exported models label their outputs with).

    Compared by identity (``eq=False``): element-wise tensor equality has no single truth value.
    """

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    class_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.x, torch.Tensor) or self.x.dtype != torch.uint8 or self.x.dim() != 4:
            got = (
                f"{self.x.dtype} {tuple(self.x.shape)}"
                if isinstance(self.x, torch.Tensor)
                else type(self.x).__name__
            )
            raise DataError(
                f"x must be a uint8 tensor N x C x H x W, got {got}; convert pixels to uint8 NCHW"
            )
        if not isinstance(self.y, torch.Tensor) or self.y.dtype != torch.int64 or self.y.dim() != 1:
            got = (
                f"{self.y.dtype} {tuple(self.y.shape)}"
                if isinstance(self.y, torch.Tensor)
                else type(self.y).__name__
            )
            raise DataError(f"y must be an int64 tensor of N labels, got {got}")
        if len(self.x) != len(self.y):
            raise DataError(
                f"x and y must have the same length, got {len(self.x)} images and {len(self.y)} labels"
            )
        if (
            isinstance(self.num_classes, bool)
            or not isinstance(self.num_classes, int)
            or self.num_classes < 1
        ):
            raise DataError(f"num_classes must be a positive integer, got {self.num_classes!r}")
        if len(self.y) and (int(self.y.min()) < 0 or int(self.y.max()) >= self.num_classes):
            raise DataError(
                f"labels must be in [0, {self.num_classes}), "
                f"got range [{int(self.y.min())}, {int(self.y.max())}]; pass the right num_classes"
            )
        if self.class_names is not None:
            names = check_class_names(
                self.class_names, num_classes=self.num_classes, source="dataset", error=DataError
            )
            object.__setattr__(self, "class_names", names)

    def __len__(self) -> int:
        return len(self.y)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one image."""
        _, c, h, w = self.x.shape
        return int(c), int(h), int(w)

    def subset(self, idx: np.ndarray | torch.Tensor) -> ArrayDataset:
        """The samples at integer positions ``idx`` (in that order), or where a boolean mask is true."""
        index = torch.as_tensor(np.asarray(idx) if not isinstance(idx, torch.Tensor) else idx)
        if index.numel() == 0 and index.dim() == 1:  # [] arrives as float64
            index = index.to(torch.int64)
        if index.dtype == torch.bool:
            if index.shape != (len(self),):
                raise DataError(f"a boolean mask must have shape ({len(self)},), got {tuple(index.shape)}")
        elif index.dtype.is_floating_point or index.dtype.is_complex or index.dim() != 1:
            raise DataError(
                f"idx must be a 1-D integer array or boolean mask, got {index.dtype} {tuple(index.shape)}"
            )
        else:
            index = index.to(torch.int64)
            if len(index) and (int(index.min()) < 0 or int(index.max()) >= len(self)):
                raise DataError(
                    f"indices must be in [0, {len(self)}), got range [{int(index.min())}, {int(index.max())}]"
                )
        index = index.to(self.x.device)
        return ArrayDataset(self.x[index], self.y[index], self.num_classes, self.class_names)

    def concat(self, other: ArrayDataset) -> ArrayDataset:
        """This set's samples, then ``other``'s (the same task: classes, names and image size)."""
        if (other.num_classes, other.class_names, other.input_shape) != (
            self.num_classes, self.class_names, self.input_shape
        ):  # fmt: skip
            raise DataError(
                f"cannot join sets of different tasks: {self.num_classes} classes of {self.input_shape} "
                f"and {other.num_classes} of {other.input_shape}"
            )
        return ArrayDataset(
            torch.cat([self.x, other.x]), torch.cat([self.y, other.y]), self.num_classes, self.class_names
        )

    def label_counts(self) -> list[int]:
        """Samples per class, length ``num_classes``."""
        return [int(v) for v in torch.bincount(self.y.cpu(), minlength=self.num_classes)]


def deploy_metadata_for(
    input_shape: tuple[int, int, int],
    num_classes: int,
    class_names: Sequence[str] | None,
    *,
    unknown_output: bool = False,
) -> dict[str, str]:
    """The deployment metadata (:mod:`export.metadata`) of a classifier of this toolkit: the class names
    (index names where nobody named them; FedOV's extra logit last), and the input spec of the pixel
    convention above (uint8 pixels / 255 in, the model normalises by PIXEL_MEAN / PIXEL_STD inside)."""
    names = tuple(class_names) if class_names is not None else index_class_names(num_classes)
    names = check_class_names(names, num_classes=num_classes, error=ConfigError)
    channels = input_shape[0]
    spec = InputSpec(
        name=INPUT_NAME,
        shape=input_shape,
        mean=(PIXEL_MEAN,) * channels,
        std=(PIXEL_STD,) * channels,
        pixel_range=(0.0, 255.0),
        input_range=(0.0, 1.0),
        normalization="inside",
    )
    return deploy_metadata(names + ((UNKNOWN_CLASS,) if unknown_output else ()), spec)


def _check_name(name: str) -> str:
    key = str(name).lower().replace("-", "").replace("_", "")
    if key not in DATASETS:
        raise ConfigError(
            f"unknown dataset {name!r}; expected one of {list(DATASETS)} "
            "(folder: your own images, with --data-root PATH holding train/<class>/ and test/<class>/)"
        )
    return key


def check_image_size(dataset: str, image_size: int | None) -> int | None:
    """``image_size`` (the side every image of a ``folder`` dataset is resized to) validated: a positive
    integer, and refused with the other datasets, whose images have their size."""
    if image_size is None:
        return None
    image_size = check_int("image_size", image_size, 1)
    if _check_name(dataset) != "folder":
        raise ConfigError(
            f"image_size applies to the folder dataset (your own images), got it with {dataset!r}; "
            "fix: drop --image-size"
        )
    return image_size


def _load_digits(split: str) -> ArrayDataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    # Pixel values are 0..16: rescale to the uint8 convention.
    x = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[:, None]
    y = digits.target.astype(np.int64)
    train_idx, test_idx = train_test_split(
        np.arange(len(y)), test_size=DIGITS_TEST_FRACTION, random_state=DIGITS_SPLIT_SEED, stratify=y
    )
    idx = np.sort(train_idx if split == "train" else test_idx)
    return ArrayDataset(torch.from_numpy(x[idx]), torch.from_numpy(y[idx]), 10, CLASS_NAMES["digits"])


def _load_torchvision(name: str, root: Path, split: str, download: bool) -> ArrayDataset:
    from torchvision import datasets as tvd

    train = split == "train"
    hint = (
        f"pass --download to fetch it into {root}, or pass the right --data-root "
        "(a torchvision-layout folder, e.g. one holding MNIST/raw/"
        f"{'; or one holding cifar10-jpeg.tar.gz' if name == 'cifar10' else ''})"
    )
    if not download and not root.is_dir():
        raise DataError(f"data root {root} does not exist; {hint}")
    try:
        if name == "mnist":
            ds = tvd.MNIST(str(root), train=train, download=download)
        elif name == "fashionmnist":
            ds = tvd.FashionMNIST(str(root), train=train, download=download)
        elif name == "cifar10":
            ds = tvd.CIFAR10(str(root), train=train, download=download)
        else:
            ds = tvd.SVHN(str(root), split=split, download=download)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, ValueError) as err:
        action = "could not be downloaded" if download else "was not found or is unreadable"
        raise DataError(f"{name} {split} split under {root} {action} ({err}); {hint}") from err
    if name in ("mnist", "fashionmnist"):
        x = ds.data.to(torch.uint8).unsqueeze(1)  # N x H x W -> N x 1 x H x W
        y = ds.targets.to(torch.int64)
    elif name == "cifar10":
        x = torch.from_numpy(np.ascontiguousarray(ds.data.transpose(0, 3, 1, 2)))  # NHWC -> NCHW
        y = torch.as_tensor(ds.targets, dtype=torch.int64)
    else:
        x = torch.from_numpy(np.ascontiguousarray(ds.data, dtype=np.uint8))  # already NCHW; labels 0..9
        y = torch.from_numpy(np.asarray(ds.labels, dtype=np.int64))
    return ArrayDataset(x.contiguous(), y, 10, CLASS_NAMES[name])


def _image_source(key: str, root: Path, download: bool) -> Path | None:
    """The folder or archive of decoded-image files a dataset is read from, None for torchvision's files:
    ``folder``'s root itself; for ``cifar10``, its JPEG copy (``cifar10-jpeg/``, ``cifar10-jpeg.tar.gz``,
    or the root being one of them) where the root has no torchvision ``cifar-10-batches-py/``."""
    if key == "folder":
        if not root.exists():
            raise DataError(
                f"data root {root} does not exist; pass --data-root PATH: a folder (or .tar.gz) holding "
                "train/<class>/ and test/<class>/ image folders"
            )
        return root
    if key != "cifar10" or download or (root / "cifar-10-batches-py").is_dir():
        return None
    for candidate in (root / CIFAR10_JPEG, root / f"{CIFAR10_JPEG}.tar.gz", root):
        is_archive = candidate.is_file() and candidate.name.endswith((".tar.gz", ".tgz"))
        if is_archive or ((candidate / "train").is_dir() and (candidate / "test").is_dir()):
            return candidate
    return None


def _load_images(key: str, source: Path, split: str, image_size: int | None) -> ArrayDataset:
    images: ImageSet = load_split_images(source, split, image_size=image_size)
    if key == "cifar10" and images.class_names != CLASS_NAMES["cifar10"]:
        raise DataError(
            f"{source} is not CIFAR-10: expected the class folders {list(CLASS_NAMES['cifar10'])}, got "
            f"{list(images.class_names or ())[:12]}; fix: pass the CIFAR-10 JPEG copy, or --dataset folder"
        )
    return ArrayDataset(
        torch.from_numpy(images.x), torch.from_numpy(images.y), images.num_classes, images.class_names
    )


def load_dataset(
    name: str,
    root: str | Path | None = None,
    *,
    split: str = "train",
    download: bool = False,
    image_size: int | None = None,
) -> ArrayDataset:
    """Load one split of a dataset as tensors (``root`` is ignored for ``digits``; ``image_size``
    applies to ``folder``, see :func:`check_image_size`)."""
    key = _check_name(name)
    image_size = check_image_size(key, image_size)
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if key == "digits":
        return _load_digits(split)
    if root is None:
        if key == "folder":
            raise DataError(
                "dataset 'folder' needs a data root: pass --data-root PATH, a folder (or .tar.gz) holding "
                "train/<class>/ and test/<class>/ image folders"
            )
        raise DataError(
            f"dataset {name!r} needs a data root: pass --data-root DIR (torchvision layout"
            f"{', or holding cifar10-jpeg.tar.gz' if key == 'cifar10' else ''}), with --download to fetch "
            "it there"
        )
    root = Path(root).expanduser()
    source = _image_source(key, root, download)
    if source is not None:
        return _load_images(key, source, split, image_size)
    return _load_torchvision(key, root, split, download)


def dataset_source(name: str, root: str | Path | None) -> dict[str, Any] | None:
    """What a dataset's data is, where it is decoded from image files (:func:`edge_sdk.images.source_key`:
    their path, sizes and times); None for digits and torchvision's files. A partition records it."""
    key = _check_name(name)
    if key == "digits" or root is None:
        return None
    source = _image_source(key, Path(root).expanduser(), download=False)
    return None if source is None else source_key(source)


def _check_alpha(alpha: float) -> float:
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float)
        or not (math.isfinite(alpha) and alpha > 0)
    ):
        raise ConfigError(f"alpha must be a positive finite number (e.g. 0.1, 0.5), got {alpha!r}")
    return float(alpha)


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    seed: int,
    *,
    min_size: int = 10,
    max_attempts: int = 1000,
) -> list[np.ndarray]:
    """Split sample indices among clients with Dirichlet(alpha) label skew.

    This is the FedDF / NIID-bench ("noniid-labeldir") scheme that the FedMHO and DENSE reference code use,
    so results compare with theirs: for each class, shuffle its indices, draw client proportions
    p ~ Dir(alpha * 1_K), zero the share of clients that already hold >= N/K samples (keeps sizes balanced),
    renormalise and cut the class at the cumulative proportions; redraw everything until the smallest client
    holds ``min_size`` samples. Smaller alpha means more skew. The draws come from
    ``np.random.default_rng(seed)`` (not bit-identical to the references' legacy global RNG), so the same
    seed gives the same partition. Returns one int64 index array per client, each shuffled by the same
    generator. An attempt in which every eligible client drew a zero share (possible at tiny alpha) counts
    as failed instead of dividing by zero.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not (np.issubdtype(labels.dtype, np.integer) or labels.size == 0):
        raise DataError(f"labels must be a 1-D integer array, got {labels.dtype} of shape {labels.shape}")
    num_clients = check_int("num_clients", num_clients, 1)
    alpha = _check_alpha(alpha)
    seed = check_int("seed", seed, 0)
    min_size = check_int("min_size", min_size, 0)
    max_attempts = check_int("max_attempts", max_attempts, 1)
    n = len(labels)
    if num_clients > n:
        raise DataError(f"num_clients must be <= the {n} samples, got {num_clients}; use fewer clients")
    if num_clients * min_size > n:
        raise DataError(
            f"{num_clients} clients x min_size {min_size} needs {num_clients * min_size} samples, "
            f"got {n}; use fewer clients (at most {n // max(min_size, 1)}) or a smaller min_size"
        )

    rng = np.random.default_rng(seed)
    cap = n / num_clients
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for _ in range(max_attempts):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        drew_zero = False
        for class_idx in by_class:
            class_idx = rng.permutation(class_idx)
            p = rng.dirichlet(np.full(num_clients, alpha)) * (sizes < cap)
            total = p.sum()
            if not total > 0:
                drew_zero = True
                break
            cuts = (np.cumsum(p / total) * len(class_idx)).astype(np.int64)[:-1]
            for j, piece in enumerate(np.split(class_idx, cuts)):
                parts[j].append(piece)
                sizes[j] += len(piece)
        if not drew_zero and sizes.min() >= min_size:
            return [rng.permutation(np.concatenate(p)).astype(np.int64) for p in parts]
    raise DataError(
        f"could not give each of {num_clients} clients >= {min_size} samples in {max_attempts} "
        "Dirichlet draws "
        f"(alpha={alpha}, {n} samples, {len(by_class)} classes); raise alpha, lower min_size or num_clients, "
        "or raise max_attempts"
    )


def split_sizes(n: int, val_fraction: float) -> tuple[int, int]:
    """(train, validation) sizes of :func:`split_train_val` on ``n`` samples, without the samples."""
    if (
        isinstance(val_fraction, bool)
        or not isinstance(val_fraction, int | float)
        or not 0 < val_fraction < 1
    ):
        raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    if n < 2:
        raise DataError(f"a train / validation split needs at least 2 samples, got {n}")
    n_val = min(max(1, round(n * val_fraction)), n - 1)
    return n - n_val, n_val


def split_train_val(
    ds: ArrayDataset, *, val_fraction: float = 0.2, seed: int
) -> tuple[ArrayDataset, ArrayDataset]:
    """A seeded random train / validation split (both non-empty; sample order kept within each part)."""
    n_val = split_sizes(len(ds), val_fraction)[1]
    seed = check_int("seed", seed, 0)
    perm = np.random.default_rng(seed).permutation(len(ds))
    return ds.subset(np.sort(perm[n_val:])), ds.subset(np.sort(perm[:n_val]))


def client_name(index: int, num_clients: int) -> str:
    """``client_07``: the name of client ``index`` of ``num_clients`` in every file a federation writes
    (``client_07.npz``, ``client_07.bundle``), zero-padded to the digits of ``num_clients`` and at least
    two (``client_00`` for 10 clients, ``client_000`` from 100 on), so the names of one run sort in client
    order and have one width."""
    num_clients = check_int("num_clients", num_clients, 1)
    index = check_int("index", index, 0)
    if index >= num_clients:
        raise ConfigError(f"client index must be in [0, {num_clients}), got {index}")
    return f"client_{index:0{max(2, len(str(num_clients)))}d}"


def data_sha256(ds: ArrayDataset) -> str:
    """sha256 of a data set's content (images, labels, class count with their dtypes and shapes), not of
    the file holding it: an ``.npz`` rewritten with the same arrays (a zip entry carries a timestamp)
    hashes the same, any changed example or label does not. A client's resume key holds it."""
    digest = hashlib.sha256()
    for name, tensor in (("x", ds.x), ("y", ds.y)):
        array = np.ascontiguousarray(tensor.cpu().numpy())
        digest.update(f"{name}|{array.dtype}|{array.shape}|".encode())
        digest.update(array.tobytes())
    digest.update(f"num_classes|{ds.num_classes}".encode())
    return digest.hexdigest()


def save_client_data(path: str | Path, ds: ArrayDataset) -> Path:
    """Write ``ds`` as an ``.npz`` (``x`` uint8 NCHW, ``y`` int64, ``num_classes``, ``class_names`` when
    known, as a 1-D unicode array), atomically."""
    buffer = io.BytesIO()
    arrays = {"x": ds.x.cpu().numpy(), "y": ds.y.cpu().numpy(), "num_classes": np.int64(ds.num_classes)}
    if ds.class_names is not None:
        arrays["class_names"] = np.array(ds.class_names, dtype=np.str_)
    np.savez(buffer, **arrays)
    return atomic_write_bytes(path, buffer.getvalue())


def _load_npz(path: Path, num_classes: int | None) -> ArrayDataset:
    hint = "expected an .npz with x (uint8 N x C x H x W) and y (integer labels), as save_client_data writes"
    try:
        with path.open("rb") as file:
            magic = file.read(6)
        # numpy reads any other bytes as a pickle and, refusing it, advises allow_pickle=True: ours says why
        if not magic.startswith((b"PK", b"\x93NUMPY")):
            raise DataError(f"client file {path} is not an .npz archive (it starts with {magic!r}); {hint}")
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise DataError(f"client file {path} holds a single array, not an .npz archive; {hint}")
        with data:
            missing = sorted({"x", "y"} - set(data.files))
            if missing:
                raise DataError(f"client file {path} lacks {missing} (has {sorted(data.files)}); {hint}")
            x, y = data["x"], data["y"]
            stored = data["num_classes"] if "num_classes" in data.files else None
            names = data["class_names"] if "class_names" in data.files else None
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"cannot read client file {path} ({err}); {hint}") from err
    if x.dtype != np.uint8 or x.ndim not in (3, 4):
        raise DataError(f"client file {path}: x must be uint8 N x C x H x W, got {x.dtype} {x.shape}; {hint}")
    if x.ndim == 3:  # N x H x W: one channel
        x = x[:, None]
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"client file {path}: y must be 1-D integer labels, got {y.dtype} {y.shape}")
    if num_classes is None and stored is not None:
        if stored.ndim != 0 or not np.issubdtype(stored.dtype, np.integer):
            raise DataError(f"client file {path}: num_classes must be an integer scalar, got {stored!r}")
        num_classes = int(stored)
    if num_classes is None:
        num_classes = int(y.max()) + 1 if len(y) else 1
    if names is not None and (names.dtype.kind != "U" or names.ndim != 1):
        raise DataError(
            f"client file {path}: class_names must be a 1-D str array, got {names.dtype} {names.shape}"
        )
    if names is not None and len(names) != num_classes:
        raise DataError(
            f"client file {path} names {len(names)} classes (class_names) but num_classes is {num_classes}; "
            "pass the num_classes the file was written for"
        )
    return ArrayDataset(
        torch.from_numpy(np.ascontiguousarray(x)),
        torch.from_numpy(y.astype(np.int64)),
        num_classes,
        None if names is None else tuple(str(n) for n in names),
    )


def _load_image_folder(root: Path, num_classes: int | None, image_size: int | None) -> ArrayDataset:
    """One sub-folder per class (integer names are class indices, other names are sorted), decoded by
    :func:`edge_sdk.images.read_image_folder`; ``num_classes`` (the federation's count) over the folders'."""
    images = read_image_folder(root, image_size=image_size)
    names = images.class_names
    if num_classes is None:
        num_classes = images.num_classes
    if names is not None and len(names) != num_classes:
        names = None  # a federation's count (num_classes) over this device's folders: the others unnamed
    return ArrayDataset(torch.from_numpy(images.x), torch.from_numpy(images.y), num_classes, names)


def load_client_data(
    path: str | Path, *, num_classes: int | None = None, image_size: int | None = None
) -> ArrayDataset:
    """Read a client's data: an ``.npz`` file (see :func:`save_client_data`) or an image-folder directory.

    ``num_classes`` (the federation's class count) overrides the count stored in or inferred from the data;
    ``image_size`` resizes an image folder's images to that square (an ``.npz`` holds its size: refused).
    """
    path = Path(path).expanduser()
    if num_classes is not None:
        num_classes = check_int("num_classes", num_classes, 1)
    if image_size is not None:
        image_size = check_int("image_size", image_size, 1)
    if not path.exists():
        raise DataError(f"client data {path} does not exist; pass an .npz file or an image-folder directory")
    if path.is_dir():
        return _load_image_folder(path, num_classes, image_size)
    if image_size is not None:
        raise ConfigError(f"image_size applies to an image folder, got the file {path}; drop --image-size")
    return _load_npz(path, num_classes)


@dataclass(frozen=True, kw_only=True)
class PartitionResult:
    """What :func:`partition` wrote: one ``.npz`` per client, the test split, and the manifest."""

    client_paths: tuple[Path, ...]
    test_path: Path
    label_histogram: tuple[tuple[int, ...], ...]
    manifest_path: Path


def partition_settings(
    dataset: str,
    *,
    num_clients: int,
    alpha: float,
    seed: int,
    min_size: int = 10,
    data_root: str | Path | None = None,
    image_size: int | None = None,
) -> dict[str, Any]:
    """The settings a partition is a function of, validated and normalised as ``partition.json`` records
    them (the dataset's key, the scheme): a rerun compares them to reuse the files or partition again.
    Data decoded from image files adds its ``source`` (:func:`dataset_source`: a changed folder or archive
    partitions again) and ``image_size`` when given."""
    settings = {
        "scheme": SCHEME,
        "dataset": _check_name(dataset),
        "num_clients": check_int("num_clients", num_clients, 1),
        "alpha": _check_alpha(alpha),
        "seed": check_int("seed", seed, 0),
        "min_size": check_int("min_size", min_size, 0),
    }
    if image_size is not None:
        settings["image_size"] = check_image_size(dataset, image_size)
    source = dataset_source(dataset, data_root)
    return settings | ({"source": source} if source is not None else {})


def client_datasets(
    dataset: str,
    data_root: str | Path | None,
    *,
    num_clients: int,
    alpha: float,
    seed: int,
    min_size: int = 10,
    download: bool = False,
    image_size: int | None = None,
) -> list[ArrayDataset]:
    """Every client's split of the dataset's train split, in memory: what :func:`partition` writes to
    ``client_*.npz`` (the same settings give the same tensors), for a node that partitions for itself
    (a Flower SuperNode given only its ``partition-id``)."""
    settings = partition_settings(
        dataset, num_clients=num_clients, alpha=alpha, seed=seed, min_size=min_size, image_size=image_size
    )
    train = load_dataset(dataset, data_root, split="train", download=download, image_size=image_size)
    return _split(train, settings)


def _split(train: ArrayDataset, settings: dict[str, Any]) -> list[ArrayDataset]:
    parts = dirichlet_partition(
        train.y.numpy(),
        settings["num_clients"],
        settings["alpha"],
        settings["seed"],
        min_size=settings["min_size"],
    )
    return [train.subset(idx) for idx in parts]


def partition(
    dataset: str,
    data_root: str | Path | None,
    *,
    num_clients: int,
    alpha: float,
    seed: int,
    out_dir: str | Path,
    min_size: int = 10,
    download: bool = False,
    image_size: int | None = None,
) -> PartitionResult:
    """Partition a dataset's train split among clients (:func:`dirichlet_partition`) and write the files.

    Writes ``client_00.npz``..., ``test.npz`` (the test split) and ``partition.json`` to ``out_dir``. Inputs
    are validated and the data loaded and partitioned before anything is written; every file is written
    atomically and the manifest last (an earlier manifest is removed first), so a directory whose
    ``partition.json`` exists is complete. Stale ``client_*.npz`` files of an earlier run are removed.
    """
    settings = partition_settings(
        dataset,
        num_clients=num_clients,
        alpha=alpha,
        seed=seed,
        min_size=min_size,
        data_root=data_root,
        image_size=image_size,
    )
    key, num_clients = settings["dataset"], settings["num_clients"]
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir must be a directory, got the file {out}")

    train = load_dataset(key, data_root, split="train", download=download, image_size=image_size)
    test = load_dataset(key, data_root, split="test", download=download, image_size=image_size)
    clients = _split(train, settings)
    histogram = tuple(tuple(c.label_counts()) for c in clients)
    names = [f"{client_name(i, num_clients)}.npz" for i in range(num_clients)]

    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "partition.json"
    manifest_path.unlink(missing_ok=True)
    for stale in out.glob("client_*.npz"):
        if stale.name not in names and stale.stem[len("client_") :].isdigit():
            stale.unlink()
    client_paths = tuple(save_client_data(out / name, c) for name, c in zip(names, clients, strict=True))
    test_path = save_client_data(out / "test.npz", test)
    atomic_write_json(
        manifest_path,
        settings
        | {
            "num_classes": train.num_classes,
            "input_shape": list(train.input_shape),
            "train_size": len(train),
            "client_files": names,
            "sizes": [len(c) for c in clients],
            "label_histogram": [list(h) for h in histogram],
            "test_file": test_path.name,
            "test_size": len(test),
            "test_label_histogram": test.label_counts(),
        },
    )
    return PartitionResult(
        client_paths=client_paths, test_path=test_path, label_histogram=histogram, manifest_path=manifest_path
    )
