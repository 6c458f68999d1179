"""Datasets, the Dirichlet partition, client files and partition(): small data made here or sklearn digits."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.errors import ConfigError, DataError
from edge_sdk.data import (
    CLASS_NAMES,
    DATASETS,
    ArrayDataset,
    client_name,
    data_sha256,
    dirichlet_partition,
    load_client_data,
    load_dataset,
    partition,
    partition_settings,
    save_client_data,
    split_train_val,
)


def make_ds(n: int = 20, num_classes: int = 4, shape: tuple[int, int, int] = (1, 3, 3)) -> ArrayDataset:
    """Image i is filled with the value i, so subsets can be traced back to their source rows."""
    x = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, *shape).contiguous()
    y = torch.arange(n, dtype=torch.int64) % num_classes
    return ArrayDataset(x, y, num_classes)


def ids(ds: ArrayDataset) -> list[int]:
    return ds.x[:, 0, 0, 0].tolist()


# ---------------------------------------------------------------- ArrayDataset


def test_array_dataset_basics() -> None:
    ds = make_ds(10, 3, (2, 4, 5))
    assert len(ds) == 10
    assert ds.input_shape == (2, 4, 5)
    assert ds.label_counts() == [4, 3, 3]  # labels 0,1,2,0,1,2,0,1,2,0


@pytest.mark.parametrize(
    ("x", "y", "k", "match"),
    [
        (torch.zeros(2, 1, 3, 3), torch.zeros(2, dtype=torch.int64), 2, "x must be a uint8"),
        (torch.zeros(2, 3, 3, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64), 2, "x must be a uint8"),
        (np.zeros((2, 1, 3, 3), np.uint8), torch.zeros(2, dtype=torch.int64), 2, "got ndarray"),
        (
            torch.zeros(2, 1, 3, 3, dtype=torch.uint8),
            torch.zeros(2, dtype=torch.int32),
            2,
            "y must be an int64",
        ),
        (torch.zeros(2, 1, 3, 3, dtype=torch.uint8), torch.zeros(3, dtype=torch.int64), 2, "same length"),
        (torch.zeros(2, 1, 3, 3, dtype=torch.uint8), torch.tensor([0, 2]), 2, r"labels must be in \[0, 2\)"),
        (torch.zeros(2, 1, 3, 3, dtype=torch.uint8), torch.tensor([0, -1]), 2, "labels must be in"),
        (torch.zeros(2, 1, 3, 3, dtype=torch.uint8), torch.tensor([0, 0]), 0, "num_classes must be"),
    ],
)
def test_array_dataset_validation(x: object, y: object, k: int, match: str) -> None:
    with pytest.raises(DataError, match=match):
        ArrayDataset(x, y, k)  # type: ignore[arg-type]


def test_subset_by_indices_and_mask() -> None:
    ds = make_ds(10)
    assert ids(ds.subset(np.array([7, 2, 2]))) == [7, 2, 2]
    assert ids(ds.subset(torch.tensor([1, 0], dtype=torch.int32))) == [1, 0]
    assert ids(ds.subset(np.array([], dtype=np.int64))) == [] == ids(ds.subset([]))  # type: ignore[arg-type]
    mask = np.zeros(10, dtype=bool)
    mask[[3, 5]] = True
    sub = ds.subset(mask)
    assert ids(sub) == [3, 5]
    assert sub.y.tolist() == [3, 1]
    assert sub.num_classes == ds.num_classes
    with pytest.raises(DataError, match=r"indices must be in \[0, 10\)"):
        ds.subset(np.array([10]))
    with pytest.raises(DataError, match="indices must be in"):
        ds.subset(np.array([-1]))
    with pytest.raises(DataError, match="boolean mask must have shape"):
        ds.subset(np.ones(3, dtype=bool))
    with pytest.raises(DataError, match="integer array"):
        ds.subset(np.array([0.5]))


# ---------------------------------------------------------------- load_dataset


def test_digits_splits() -> None:
    from sklearn.datasets import load_digits

    train, test = load_dataset("digits"), load_dataset("digits", split="test")
    assert train.x.dtype == torch.uint8 and train.input_shape == (1, 8, 8) and train.num_classes == 10
    # 1797 samples, stratified 75 / 25: sklearn puts ceil(0.25 * 1797) = 450 in the test split.
    assert (len(train), len(test)) == (1347, 450)
    assert all(43 <= c <= 47 for c in test.label_counts())  # ~180 per class x 0.25
    # Together the two splits are exactly the 1797 images, rescaled 0..16 -> 0..255.
    digits = load_digits()
    expected = np.round(digits.images * 255 / 16).astype(np.uint8)
    rows = sorted(r.tobytes() + bytes([int(t)]) for r, t in zip(expected, digits.target, strict=True))
    got = torch.cat([train.x, test.x]).numpy()[:, 0]
    labels = torch.cat([train.y, test.y]).numpy()
    assert sorted(r.tobytes() + bytes([int(t)]) for r, t in zip(got, labels, strict=True)) == rows
    assert int(train.x.max()) == 255  # 16 * 255 / 16
    assert torch.equal(load_dataset("DIGITS").x, train.x)  # deterministic and case-insensitive


def write_idx(path: Path, arr: np.ndarray) -> None:
    """IDX file (the MNIST format): magic 0x0000 08 <ndim>, big-endian dims, then uint8 data."""
    header = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + b"".join(struct.pack(">I", d) for d in arr.shape)
    path.write_bytes(header + arr.astype(np.uint8).tobytes())


@pytest.mark.parametrize(("name", "folder"), [("mnist", "MNIST"), ("fashionmnist", "FashionMNIST")])
def test_torchvision_layout_is_read_without_download(tmp_path: Path, name: str, folder: str) -> None:
    raw = tmp_path / folder / "raw"
    raw.mkdir(parents=True)
    images = np.random.default_rng(0).integers(0, 256, (12, 28, 28))
    write_idx(raw / "train-images-idx3-ubyte", images)
    write_idx(raw / "train-labels-idx1-ubyte", np.arange(12) % 10)
    write_idx(raw / "t10k-images-idx3-ubyte", images[:5])
    write_idx(raw / "t10k-labels-idx1-ubyte", np.arange(5))
    train = load_dataset(name, tmp_path)
    assert train.x.shape == (12, 1, 28, 28) and train.x.dtype == torch.uint8
    assert np.array_equal(train.x[:, 0].numpy(), images)
    assert train.y.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    assert len(load_dataset(name, tmp_path, split="test")) == 5


def test_load_dataset_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown dataset 'imagenet'; expected one of") as err:
        load_dataset("imagenet", tmp_path)
    assert all(name in str(err.value) for name in DATASETS)
    with pytest.raises(ConfigError, match="split must be one of"):
        load_dataset("digits", split="val")
    with pytest.raises(DataError, match="needs a data root: pass --data-root"):
        load_dataset("mnist", None)
    with pytest.raises(DataError, match=r"does not exist; pass --download .* or pass the right --data-root"):
        load_dataset("cifar10", tmp_path / "missing")
    for name in ("mnist", "cifar10", "svhn"):
        with pytest.raises(DataError, match=r"not found or is unreadable .*--download"):
            load_dataset(name, tmp_path)


# ---------------------------------------------------------------- dirichlet_partition


def reference_partition(
    labels: np.ndarray, k: int, alpha: float, seed: int, min_size: int
) -> list[np.ndarray]:
    """The FedDF / NIID-bench loop written out from its description, with the same generator calls."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    for _ in range(1000):
        batches: list[list[int]] = [[] for _ in range(k)]
        for c in np.unique(labels):
            idx_c = rng.permutation(np.flatnonzero(labels == c))
            p = rng.dirichlet([alpha] * k)
            p = np.array([pj * (len(b) < n / k) for pj, b in zip(p, batches, strict=True)])
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx_c)).astype(int)[:-1]
            batches = [b + part.tolist() for b, part in zip(batches, np.split(idx_c, cuts), strict=True)]
        if min(len(b) for b in batches) >= min_size:
            return [rng.permutation(np.array(b, dtype=np.int64)) for b in batches]
    raise AssertionError("the reference loop found no partition")


@pytest.fixture(scope="module")
def digit_labels() -> np.ndarray:
    return load_dataset("digits").y.numpy()


@pytest.mark.parametrize(("k", "alpha", "seed"), [(5, 0.5, 0), (10, 0.1, 3), (3, 100.0, 7)])
def test_partition_matches_the_reference_scheme(
    digit_labels: np.ndarray, k: int, alpha: float, seed: int
) -> None:
    parts = dirichlet_partition(digit_labels, k, alpha, seed, min_size=10)
    expected = reference_partition(digit_labels, k, alpha, seed, 10)
    assert len(parts) == k
    for got, want in zip(parts, expected, strict=True):
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want)
    everything = np.concatenate(parts)
    assert len(everything) == len(digit_labels) == len(np.unique(everything))  # disjoint cover
    assert min(len(p) for p in parts) >= 10


def test_partition_is_seeded_and_alpha_controls_skew(digit_labels: np.ndarray) -> None:
    a = dirichlet_partition(digit_labels, 8, 0.3, seed=1)
    b = dirichlet_partition(digit_labels, 8, 0.3, seed=1)
    c = dirichlet_partition(digit_labels, 8, 0.3, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))

    def top_class_share(parts: list[np.ndarray]) -> float:
        return float(np.mean([np.bincount(digit_labels[p], minlength=10).max() / len(p) for p in parts]))

    skewed = top_class_share(dirichlet_partition(digit_labels, 8, 0.05, seed=0, min_size=1))
    uniform = top_class_share(dirichlet_partition(digit_labels, 8, 1000.0, seed=0, min_size=1))
    assert skewed > 0.5 and uniform < 0.2  # IID gives ~0.1 (10 classes); a seeded numpy draw, no kernels


def test_partition_errors(digit_labels: np.ndarray) -> None:
    for alpha in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="alpha must be a positive finite number"):
            dirichlet_partition(digit_labels, 3, alpha, 0)
    with pytest.raises(ConfigError, match="num_clients must be an integer >= 1, got 0"):
        dirichlet_partition(digit_labels, 0, 0.5, 0)
    with pytest.raises(DataError, match="num_clients must be <= the 5 samples, got 6"):
        dirichlet_partition(np.arange(5) % 2, 6, 0.5, 0, min_size=0)
    with pytest.raises(
        DataError, match=r"200 clients x min_size 10 needs 2000 samples, got 1347; .*at most 134"
    ):
        dirichlet_partition(digit_labels, 200, 0.5, 0)
    with pytest.raises(DataError, match="1-D integer array"):
        dirichlet_partition(np.zeros((4, 2), dtype=np.int64), 2, 0.5, 0)
    with pytest.raises(ConfigError, match="seed must be an integer >= 0"):
        dirichlet_partition(digit_labels, 3, 0.5, -1)
    # 100 samples, 10 clients, min_size 10: only an exactly even split passes, which Dir(0.01) never draws.
    with pytest.raises(DataError, match=r"in 5 Dirichlet draws .*raise alpha"):
        dirichlet_partition(np.arange(100) % 10, 10, 0.01, 0, min_size=10, max_attempts=5)


# ---------------------------------------------------------------- split_train_val


def test_split_train_val() -> None:
    ds = make_ds(50)
    train, val = split_train_val(ds, val_fraction=0.2, seed=0)
    assert (len(train), len(val)) == (40, 10)
    assert sorted(ids(train) + ids(val)) == list(range(50))
    again, _ = split_train_val(ds, val_fraction=0.2, seed=0)
    other, _ = split_train_val(ds, val_fraction=0.2, seed=1)
    assert ids(again) == ids(train) and ids(other) != ids(train)
    assert [len(p) for p in split_train_val(make_ds(2), val_fraction=0.01, seed=0)] == [1, 1]
    for bad in (0, 1, 1.5, -0.1):
        with pytest.raises(ConfigError, match=r"val_fraction must be in \(0, 1\)"):
            split_train_val(ds, val_fraction=bad, seed=0)
    with pytest.raises(DataError, match="at least 2 samples, got 1"):
        split_train_val(make_ds(1), seed=0)


def test_class_names_travel_with_the_data() -> None:
    assert set(CLASS_NAMES) == set(DATASETS) - {"folder"}  # a folder's classes are its sub-folders
    assert all(len(names) == 10 == len(set(names)) for names in CLASS_NAMES.values())
    assert CLASS_NAMES["fashionmnist"][0] == "T-shirt/top" and CLASS_NAMES["cifar10"][-1] == "truck"
    digits = load_dataset("digits", split="test")
    assert digits.class_names == tuple("0123456789")
    train, val = split_train_val(digits, seed=0)
    assert train.class_names == val.class_names == digits.class_names
    assert make_ds().class_names is None  # nobody named them
    with pytest.raises(DataError, match="3 class names for 4 classes"):
        ArrayDataset(make_ds().x, make_ds().y, 4, ("a", "b", "c"))
    with pytest.raises(DataError, match="unique"):
        ArrayDataset(make_ds().x, make_ds().y, 4, ("a", "b", "c", "a"))


# ---------------------------------------------------------------- client files


def test_npz_keeps_class_names_and_refuses_bad_ones(tmp_path: Path) -> None:
    ds = make_ds(8, 2)
    named = ArrayDataset(ds.x, ds.y, 2, ("left", "right"))
    back = load_client_data(save_client_data(tmp_path / "named.npz", named))
    assert back.class_names == ("left", "right") and torch.equal(back.x, ds.x)
    assert load_client_data(save_client_data(tmp_path / "plain.npz", ds)).class_names is None
    with pytest.raises(DataError, match=r"names 2 classes .* but num_classes is 5"):
        load_client_data(tmp_path / "named.npz", num_classes=5)
    np.savez(tmp_path / "ints.npz", x=ds.x.numpy(), y=ds.y.numpy(), class_names=np.array([1, 2]))
    with pytest.raises(DataError, match="class_names must be a 1-D str array"):
        load_client_data(tmp_path / "ints.npz")


def test_npz_round_trip_is_atomic(tmp_path: Path) -> None:
    ds = make_ds(9, 5, (3, 2, 4))
    path = save_client_data(tmp_path / "c.npz", ds)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]  # no temp file left behind
    back = load_client_data(path)
    assert torch.equal(back.x, ds.x) and torch.equal(back.y, ds.y) and back.num_classes == 5
    assert load_client_data(path, num_classes=12).num_classes == 12


def test_npz_variants_and_errors(tmp_path: Path) -> None:
    np.savez(tmp_path / "plain.npz", x=np.zeros((3, 4, 4), np.uint8), y=np.array([0, 3, 1], np.int32))
    plain = load_client_data(tmp_path / "plain.npz")
    assert plain.input_shape == (1, 4, 4) and plain.num_classes == 4 and plain.y.dtype == torch.int64

    np.savez(tmp_path / "float.npz", x=np.zeros((3, 1, 4, 4), np.float32), y=np.zeros(3, np.int64))
    np.savez(tmp_path / "nox.npz", y=np.zeros(3, np.int64))
    np.save(tmp_path / "single.npy", np.zeros(3))
    (tmp_path / "garbage.npz").write_bytes(b"definitely not a zip archive")
    good = (tmp_path / "plain.npz").read_bytes()
    (tmp_path / "truncated.npz").write_bytes(good[: len(good) // 2])
    cases = {
        "float.npz": "x must be uint8",
        "nox.npz": r"lacks \['x'\]",
        "single.npy": "not an .npz archive",
        "garbage.npz": r"is not an \.npz archive \(it starts with b'defini'\)",  # not numpy's pickle advice
        "truncated.npz": "cannot read client file",
        "missing.npz": "does not exist",
    }
    for name, match in cases.items():
        with pytest.raises(DataError, match=match):
            load_client_data(tmp_path / name)
    with pytest.raises(DataError, match=r"labels must be in \[0, 2\)"):
        load_client_data(tmp_path / "plain.npz", num_classes=2)


def save_png(path: Path, value: int, size: tuple[int, int] = (5, 4), mode: str = "L") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    colour = value if mode == "L" else (value, 0, 255 - value)
    Image.new(mode, size, colour).save(path)


def test_image_folder_named_classes(tmp_path: Path) -> None:
    save_png(tmp_path / "cat" / "a.png", 10)
    save_png(tmp_path / "cat" / "b.png", 20)
    save_png(tmp_path / "ant" / "c.png", 30)
    (tmp_path / "ant" / "notes.txt").write_text("not an image")
    ds = load_client_data(tmp_path)
    assert ds.x.shape == (3, 1, 4, 5)  # PIL size is (width, height)
    assert ds.y.tolist() == [0, 1, 1]  # sorted names: ant -> 0, cat -> 1
    assert ds.x[:, 0, 0, 0].tolist() == [30, 10, 20] and ds.num_classes == 2
    assert ds.class_names == ("ant", "cat")  # the folders name the classes


def test_image_folder_integer_classes_and_colour(tmp_path: Path) -> None:
    save_png(tmp_path / "0" / "a.png", 10)
    save_png(tmp_path / "2" / "b.png", 40, mode="RGB")
    ds = load_client_data(tmp_path)
    assert ds.y.tolist() == [0, 2] and ds.num_classes == 3
    assert ds.x.shape == (2, 3, 4, 5)  # one colour image makes the whole set RGB
    assert ds.x[0, :, 0, 0].tolist() == [10, 10, 10] and ds.x[1, :, 0, 0].tolist() == [40, 0, 215]


def test_image_folder_errors(tmp_path: Path) -> None:
    save_png(tmp_path / "sizes" / "0" / "a.png", 1)
    save_png(tmp_path / "sizes" / "1" / "b.png", 1, size=(6, 6))
    save_png(tmp_path / "broken" / "0" / "a.png", 1)
    (tmp_path / "broken" / "0" / "b.png").write_bytes(b"not a png")
    save_png(tmp_path / "stray" / "top.png", 1)
    (tmp_path / "empty" / "0").mkdir(parents=True)
    (tmp_path / "nodirs").mkdir()
    cases = {
        "sizes": "is 6x6, others are 5x4",
        "broken": "cannot read image",
        "stray": "images outside class folders",
        "empty": "holds no images",
        "nodirs": "no class sub-folders",
    }
    for name, match in cases.items():
        with pytest.raises(DataError, match=match):
            load_client_data(tmp_path / name)


# ---------------------------------------------------------------- partition()


def test_partition_writes_clients_test_and_manifest(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = partition("digits", None, num_clients=3, alpha=0.5, seed=0, out_dir=out)
    assert [p.name for p in result.client_paths] == ["client_00.npz", "client_01.npz", "client_02.npz"]
    assert sorted(p.name for p in out.iterdir()) == [
        "client_00.npz",
        "client_01.npz",
        "client_02.npz",
        "partition.json",
        "test.npz",
    ]
    train, test = load_dataset("digits"), load_dataset("digits", split="test")
    clients = [load_client_data(p) for p in result.client_paths]
    assert tuple(tuple(c.label_counts()) for c in clients) == result.label_histogram
    expected = dirichlet_partition(train.y.numpy(), 3, 0.5, 0, min_size=10)
    for client, idx in zip(clients, expected, strict=True):
        assert torch.equal(client.x, train.x[idx]) and torch.equal(client.y, train.y[idx])
    assert torch.equal(load_client_data(result.test_path).x, test.x)
    assert all(c.class_names == train.class_names == tuple("0123456789") for c in clients)

    manifest = json.loads(result.manifest_path.read_text())
    assert manifest["dataset"] == "digits" and manifest["num_clients"] == 3
    assert (manifest["alpha"], manifest["seed"], manifest["min_size"]) == (0.5, 0, 10)
    assert manifest["sizes"] == [len(c) for c in clients] and sum(manifest["sizes"]) == 1347
    assert manifest["label_histogram"] == [list(h) for h in result.label_histogram]
    assert "FedDF" in manifest["scheme"] and manifest["test_size"] == 450
    assert result.manifest_path.read_text() == json.dumps(manifest, sort_keys=True, indent=2) + "\n"


def test_partition_rerun_replaces_stale_clients_and_pads_names(tmp_path: Path) -> None:
    partition("digits", None, num_clients=4, alpha=1.0, seed=0, out_dir=tmp_path)
    (tmp_path / "client_notes.npz").write_bytes(b"user file")  # not ours: kept
    partition("digits", None, num_clients=2, alpha=1.0, seed=0, out_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.glob("client_*.npz")) == [
        "client_00.npz",
        "client_01.npz",
        "client_notes.npz",
    ]
    many = partition(
        "digits", None, num_clients=100, alpha=100.0, seed=0, out_dir=tmp_path / "many", min_size=1
    )
    assert many.client_paths[0].name == "client_000.npz" and many.client_paths[-1].name == "client_099.npz"


def test_client_names_are_padded_to_the_digits_of_the_client_count() -> None:
    # at least two digits; three from 100 clients on, so one run's names sort in client order
    assert [client_name(k, 9) for k in (0, 8)] == ["client_00", "client_08"]
    assert client_name(9, 10) == "client_09"
    assert [client_name(k, 100) for k in (0, 7, 99)] == ["client_000", "client_007", "client_099"]
    assert client_name(1000, 1001) == "client_1000"
    names = [client_name(k, 120) for k in range(120)]
    assert sorted(names) == names and len({len(n) for n in names}) == 1
    with pytest.raises(ConfigError, match=r"client index must be in \[0, 3\), got 3"):
        client_name(3, 3)


def test_data_hash_follows_the_content_not_the_file(tmp_path: Path) -> None:
    ds = make_ds()
    first = save_client_data(tmp_path / "a.npz", ds)
    again = save_client_data(tmp_path / "b.npz", make_ds())
    assert data_sha256(load_client_data(first)) == data_sha256(load_client_data(again)) == data_sha256(ds)
    y = ds.y.clone()
    y[0] = (y[0] + 1) % ds.num_classes
    assert data_sha256(ArrayDataset(ds.x, y, ds.num_classes)) != data_sha256(ds)
    assert data_sha256(ArrayDataset(ds.x, ds.y, ds.num_classes + 1)) != data_sha256(ds)


def test_partition_records_the_settings_a_rerun_compares(tmp_path: Path) -> None:
    result = partition("Digits", None, num_clients=2, alpha=1, seed=3, out_dir=tmp_path, min_size=5)
    manifest = json.loads(result.manifest_path.read_text())
    settings = partition_settings("digits", num_clients=2, alpha=1.0, seed=3, min_size=5)
    assert settings == {k: manifest[k] for k in settings}
    assert set(settings) == {"scheme", "dataset", "num_clients", "alpha", "seed", "min_size"}
    with pytest.raises(ConfigError, match="alpha"):
        partition_settings("digits", num_clients=2, alpha=0, seed=3)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dataset": "imagenet"}, ConfigError, "unknown dataset"),
        ({"alpha": 0.0}, ConfigError, "alpha must be"),
        ({"num_clients": 0}, ConfigError, "num_clients must be"),
        ({"num_clients": 200}, DataError, "needs 2000 samples"),
        ({"dataset": "mnist"}, DataError, "needs a data root"),
    ],
)
def test_partition_failure_writes_nothing(tmp_path: Path, kwargs: dict, error: type, match: str) -> None:
    args = {"dataset": "digits", "num_clients": 3, "alpha": 0.5} | kwargs
    out = tmp_path / "out"
    with pytest.raises(error, match=match):
        partition(args.pop("dataset"), None, seed=0, out_dir=out, **args)
    assert not out.exists()


def test_partition_keeps_previous_output_when_validation_fails(tmp_path: Path) -> None:
    partition("digits", None, num_clients=2, alpha=0.5, seed=0, out_dir=tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(DataError):
        partition("digits", None, num_clients=500, alpha=0.5, seed=0, out_dir=tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="out_dir must be a directory"):
        partition("digits", None, num_clients=2, alpha=0.5, seed=0, out_dir=tmp_path / "afile")
