"""Colour image data: a user's train/test image folder (or .tar.gz), CIFAR-10's JPEG copy, the decode cache,
bad files, and `edge-sdk partition` on a folder. Every image is made here, a few pixels each."""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.errors import ConfigError, DataError
from edge_sdk import image_cache, images
from edge_sdk.cli import main as edge_main
from edge_sdk.data import CLASS_NAMES, load_client_data, load_dataset, partition_settings
from edge_sdk.image_cache import CACHE_ENV
from edge_sdk.images import read_split_images

CLASSES = ("bird", "cat", "dog")


def noise(seed: int, size: tuple[int, int] = (6, 5), mode: str = "RGB") -> Image.Image:
    """A random image of ``size`` (width, height): its pixels are what a lossless file must give back."""
    shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
    pixels = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


def make_split_folder(
    root: Path, *, classes: tuple[str, ...] = CLASSES, train: int = 4, test: int = 2, suffix: str = ".png"
) -> Path:
    """root/{train,test}/<class>/NNNN<suffix>: random colour images, 6 wide and 5 high."""
    for split, count in (("train", train), ("test", test)):
        for c, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                noise(1000 * c + 10 * i + (split == "test")).save(folder / f"{i:04d}{suffix}")
    return root


def make_tar(folder: Path, path: Path, *, top: str = "data") -> Path:
    """``folder`` as a .tar.gz under ``top/``, its files added in reverse name order (an archive need not be
    sorted: the reader orders them as the folder's)."""
    with tarfile.open(path, "w:gz") as tar:
        for f in sorted(folder.rglob("*"), reverse=True):
            if f.is_file():
                tar.add(f, arcname=f"{top}/{f.relative_to(folder).as_posix()}")
    return path


def add_member(tar: tarfile.TarFile, name: str, data: bytes = b"", **fields) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in fields.items():
        setattr(info, key, value)
    tar.addfile(info, io.BytesIO(data) if data else None)


# ---------------------------------------------------------------- a folder data set


def test_folder_splits_class_names_and_pixels(tmp_path: Path) -> None:
    root = make_split_folder(tmp_path / "photos")
    train = load_dataset("folder", root, split="train")
    test = load_dataset("folder", root, split="test")
    assert train.x.shape == (12, 3, 5, 6) and test.x.shape == (6, 3, 5, 6)  # PIL size is (width, height)
    assert train.class_names == test.class_names == CLASSES and train.num_classes == 3
    assert train.y.tolist() == [0] * 4 + [1] * 4 + [2] * 4 and test.label_counts() == [2, 2, 2]
    # PNG is lossless: the pixels written come back, channels first, in (class, file name) order
    expected = np.asarray(noise(1000 * 2 + 10 * 1)).transpose(2, 0, 1)
    assert np.array_equal(train.x[9].numpy(), expected)  # dog/0001.png
    assert np.array_equal(test.x[0].numpy(), np.asarray(noise(1)).transpose(2, 0, 1))  # test/bird/0000.png


def test_resize_scales_and_centre_crops_any_size_to_one_square(tmp_path: Path) -> None:
    root = tmp_path / "photos"
    for split in ("train", "test"):
        (root / split / "red").mkdir(parents=True)
        (root / split / "grey").mkdir(parents=True)
        Image.new("RGB", (40, 12), (200, 10, 30)).save(root / split / "red" / "wide.png")
        Image.new("RGB", (9, 31), (200, 10, 30)).save(root / split / "red" / "tall.jpg", quality=100)
        Image.new("L", (17, 17), 77).save(root / split / "grey" / "square.png")
    with pytest.raises(
        DataError, match=r"tall.jpg is 9x31, others are 17x17; fix: give an image size \(--image-size\)"
    ):
        load_dataset("folder", root)
    train = load_dataset("folder", root, image_size=8)
    assert train.x.shape == (3, 3, 8, 8) and train.class_names == ("grey", "red")
    assert (train.x[0] == 77).all()  # a grey image in a colour set: its value in every channel
    red = train.x[1:].to(torch.int16)
    # JPEG: a flat colour comes back within a few grey levels of chroma rounding (integer IDCT, no torch)
    assert (red - torch.tensor([200, 10, 30], dtype=torch.int16).view(1, 3, 1, 1)).abs().max() <= 3


def test_tar_and_folder_give_identical_arrays(tmp_path: Path) -> None:
    folder = make_split_folder(tmp_path / "photos", suffix=".jpg")
    (folder / "README.txt").write_text("not an image: skipped")
    (folder / "train" / "notes.txt").write_text("not an image, nor a class folder")
    (folder / "train" / "cat" / ".hidden.jpg").write_bytes(b"skipped as a folder skips it")
    archive = make_tar(folder, tmp_path / "photos.tar.gz")
    from_folder, from_tar = read_split_images(folder), read_split_images(archive)
    for split in ("train", "test"):
        a, b = from_folder[split], from_tar[split]
        assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y) and a.class_names == b.class_names
    assert from_tar["train"].x.shape == (12, 3, 5, 6)
    # through load_dataset (and its cache) too
    assert torch.equal(load_dataset("folder", archive).x, load_dataset("folder", folder).x)


def test_integer_class_folders_are_class_indices(tmp_path: Path) -> None:
    root = make_split_folder(tmp_path / "digits", classes=("0", "2", "10"), train=1, test=1)
    train = load_dataset("folder", make_tar(root, tmp_path / "digits.tar.gz"))
    assert train.class_names is None and train.num_classes == 11 and train.y.tolist() == [0, 2, 10]


def test_all_grey_stays_one_channel(tmp_path: Path) -> None:
    root = tmp_path / "grey"
    for split in ("train", "test"):
        for name, value in (("a", 10), ("b", 250)):
            (root / split / name).mkdir(parents=True)
            Image.new("L", (4, 4), value).save(root / split / name / "x.png")
            Image.new("1", (4, 4), 1).save(root / split / name / "y.png")  # 1-bit: 0 or 255
    train = load_dataset("folder", root)
    assert train.x.shape == (4, 1, 4, 4)
    assert train.x[:, 0, 0, 0].tolist() == [10, 255, 250, 255]


def test_class_folders_must_match_between_splits(tmp_path: Path) -> None:
    root = make_split_folder(tmp_path / "photos", train=1, test=1)
    (root / "test" / "dog" / "0000.png").unlink()
    (root / "test" / "dog").rmdir()
    (root / "test" / "eel").mkdir()
    with pytest.raises(
        DataError, match=r"train/ and test/ differ \(only in train: \['dog'\], only in test: \['eel'\]"
    ):
        load_dataset("folder", root)
    with pytest.raises(DataError, match=r"train has no train/ and no test/; expected train/<class>/"):
        load_dataset("folder", root / "train")
    with pytest.raises(DataError, match=r"needs a data root: pass --data-root PATH"):
        load_dataset("folder", None)
    with pytest.raises(DataError, match=r"does not exist"):
        load_dataset("folder", tmp_path / "missing")


def test_image_size_applies_to_image_folders_only(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"image_size applies to the folder dataset .* got it with 'digits'"
    ):
        load_dataset("digits", image_size=8)
    with pytest.raises(ConfigError, match="image_size must be an integer >= 1"):
        load_dataset("folder", tmp_path, image_size=0)
    np.savez(tmp_path / "c.npz", x=np.zeros((2, 1, 4, 4), np.uint8), y=np.array([0, 1]))
    with pytest.raises(ConfigError, match="image_size applies to an image folder"):
        load_client_data(tmp_path / "c.npz", image_size=4)
    (tmp_path / "client" / "cat").mkdir(parents=True)
    noise(0, (9, 7)).save(tmp_path / "client" / "cat" / "a.png")
    noise(1, (5, 5)).save(tmp_path / "client" / "cat" / "b.png")
    assert load_client_data(tmp_path / "client", image_size=4).x.shape == (2, 3, 4, 4)


# ---------------------------------------------------------------- bad files


def bad_png(kind: str) -> bytes:
    buffer = io.BytesIO()
    noise(0, (20, 20)).save(buffer, format="PNG")
    data = buffer.getvalue()
    return {"truncated": data[: len(data) // 2], "not an image": b"hello, not a picture", "empty": b""}[kind]


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("truncated", "image file is truncated"),
        ("not an image", "not an image"),
        ("empty", r"\(0 bytes\): not an image"),
    ],
)
def test_a_bad_file_is_one_error_naming_it(tmp_path: Path, kind: str, match: str) -> None:
    root = make_split_folder(tmp_path / "photos", train=2, test=1)
    bad = root / "train" / "cat" / "0001.png"
    bad.write_bytes(bad_png(kind))
    with pytest.raises(DataError, match=f"cannot read image {bad}.*{match}.*fix: replace or delete"):
        load_dataset("folder", root)
    with pytest.raises(DataError, match=f"cannot read image .*:train/cat/0001.png.*{match}"):
        read_split_images(make_tar(root, tmp_path / "p.tar.gz"))


def test_a_truncated_jpeg_names_the_file(tmp_path: Path) -> None:
    root = make_split_folder(tmp_path / "photos", train=1, test=1, suffix=".jpg")
    bad = root / "test" / "dog" / "0000.jpg"
    buffer = io.BytesIO()
    noise(5, (64, 64)).save(buffer, format="JPEG")
    bad.write_bytes(buffer.getvalue()[:300])
    with pytest.raises(DataError, match=f"cannot read image {bad}"):
        load_dataset("folder", root)


def test_mixed_modes_are_converted_to_rgb(tmp_path: Path) -> None:
    root = make_split_folder(tmp_path / "photos", train=1, test=1)
    folder = root / "train" / "cat"
    base = noise(7)
    base.convert("P").save(folder / "palette.png")
    base.convert("RGBA").save(folder / "alpha.png")
    base.convert("CMYK").save(folder / "cmyk.jpg")
    base.convert("LA").save(folder / "greyalpha.png")
    wide = np.full((5, 6), 65535, dtype=np.uint16)
    wide[0, 0] = 257 * 100
    Image.fromarray(wide).save(folder / "sixteen.png")  # 16-bit grey
    assert Image.open(folder / "sixteen.png").mode == "I;16"
    train = load_dataset("folder", root)
    assert train.x.shape == (8, 3, 5, 6) and train.label_counts() == [1, 6, 1]
    by_name = dict(
        zip(["0000", "alpha", "cmyk", "greyalpha", "palette", "sixteen"], train.x[1:7], strict=True)
    )
    assert np.array_equal(by_name["alpha"].numpy(), np.asarray(base).transpose(2, 0, 1))  # alpha dropped
    assert np.array_equal(
        by_name["palette"].numpy(), np.asarray(base.convert("P").convert("RGB")).transpose(2, 0, 1)
    )
    assert np.array_equal(by_name["greyalpha"][0].numpy(), np.asarray(base.convert("L")))
    sixteen = by_name["sixteen"]
    assert sixteen[:, 0, 0].tolist() == [100] * 3 and int(sixteen[:, 1:].min()) == 255  # 0..65535 -> 0..255
    assert (
        (by_name["cmyk"].to(torch.int16) - by_name["alpha"].to(torch.int16)).abs().float().mean() < 12
    )  # JPEG of a CMYK image vs the RGB original: lossy, but a few levels on average


def test_a_mode_without_a_fixed_range_is_refused_naming_the_file(tmp_path: Path) -> None:
    root = make_split_folder(tmp_path / "photos", train=1, test=1)
    bad = root / "train" / "bird" / "float.tif"
    Image.fromarray(np.ones((5, 6), dtype=np.float32)).save(bad)
    with pytest.raises(DataError, match=f"image {bad} has pixel mode 'F'.*fix: save it as 8-bit"):
        load_dataset("folder", root)


def test_bounds_are_checked_before_decoding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_split_folder(tmp_path / "photos", train=2, test=1)
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 29)  # 6 x 5 = 30
    with pytest.raises(DataError, match=r"image .*0000.png is 6x5, more than 29 pixels"):
        read_split_images(root)
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 30)
    monkeypatch.setattr(images, "MAX_IMAGES", 8)
    with pytest.raises(DataError, match="holds more than 8 images"):
        read_split_images(root)
    with pytest.raises(DataError, match="more than 8 images at"):
        read_split_images(make_tar(root, tmp_path / "p.tar.gz"))
    monkeypatch.setattr(images, "MAX_IMAGES", 100)
    monkeypatch.setattr(images, "MAX_FILE_BYTES", 50)
    with pytest.raises(DataError, match=r"member data/train/.* is \d+ bytes, more than 50"):
        read_split_images(tmp_path / "p.tar.gz")
    with pytest.raises(DataError, match=r"image .*\.png is \d+ bytes, more than 50"):
        read_split_images(root)


@pytest.mark.parametrize(
    ("member", "match"),
    [
        (
            {"name": "data/train/cat/link.png", "type": tarfile.SYMTYPE, "linkname": "/etc/passwd"},
            "is a link",
        ),
        ({"name": "data/train/cat/hard.png", "type": tarfile.LNKTYPE, "linkname": "data/x"}, "is a link"),
        ({"name": "../evil.png"}, "absolute or parent path"),
        ({"name": "/abs/train/cat/a.png"}, "absolute or parent path"),
        ({"name": "data/train/cat/fifo.png", "type": tarfile.FIFOTYPE}, "a special file"),
    ],
)
def test_archive_refuses_links_paths_and_special_files(tmp_path: Path, member: dict, match: str) -> None:
    path = tmp_path / "evil.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        add_member(tar, member.pop("name"), b"" if "type" in member else b"x", **member)
    with pytest.raises(DataError, match=f"archive {path}: member .* {match}; fix: repack it"):
        read_split_images(path)


def test_a_file_that_is_no_archive_is_one_error(tmp_path: Path) -> None:
    path = tmp_path / "photos.tar.gz"
    path.write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(DataError, match=f"cannot read {path}"):
        load_dataset("folder", path)


# ---------------------------------------------------------------- CIFAR-10's JPEG copy


def make_cifar_root(root: Path) -> Path:
    """root/cifar10-jpeg.tar.gz (cifar10-jpeg/{train,test}/<class>/NNNN.jpg) and the folder it packs."""
    folder = make_split_folder(
        root / "unpacked", classes=CLASS_NAMES["cifar10"], train=2, test=1, suffix=".jpg"
    )
    make_tar(folder, root / "cifar10-jpeg.tar.gz", top="cifar10-jpeg")
    return folder


def test_cifar10_from_the_archive_or_its_unpacked_folder(tmp_path: Path) -> None:
    unpacked = make_cifar_root(tmp_path / "root")
    train = load_dataset("cifar10", tmp_path / "root")
    assert train.x.shape == (20, 3, 5, 6) and train.class_names == CLASS_NAMES["cifar10"]
    assert (
        train.label_counts() == [2] * 10
        and len(load_dataset("cifar10", tmp_path / "root", split="test")) == 10
    )
    # the unpacked folder (cifar10-jpeg/ in the root) gives the same arrays
    other = tmp_path / "other"
    other.mkdir()
    unpacked.rename(other / "cifar10-jpeg")
    again = load_dataset("cifar10", other)
    assert torch.equal(again.x, train.x) and torch.equal(again.y, train.y)
    # torchvision's files come first where they are
    (other / "cifar-10-batches-py").mkdir()
    with pytest.raises(DataError, match="not found or is unreadable"):
        load_dataset("cifar10", other)


def test_cifar10_refuses_an_archive_of_other_classes(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    make_tar(make_split_folder(tmp_path / "x", train=1, test=1), tmp_path / "root" / "cifar10-jpeg.tar.gz")
    with pytest.raises(
        DataError,
        match=r"is not CIFAR-10: expected the class folders \['airplane'.*got \['bird', 'cat', 'dog'\]",
    ):
        load_dataset("cifar10", tmp_path / "root")


# ---------------------------------------------------------------- the cache


def test_cache_is_written_once_reused_and_renewed_when_the_source_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    archive = make_tar(make_split_folder(tmp_path / "photos"), tmp_path / "photos.tar.gz")
    with caplog.at_level(logging.INFO, logger="edge_sdk.image_cache"):
        first = load_dataset("folder", archive)
    files = list((tmp_path / "cache" / "images").glob("*.npz"))
    assert len(files) == 1 and f"the cache {files[0]}" in caplog.text
    written = files[0].stat().st_mtime_ns

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded again instead of reading the cache")

    monkeypatch.setattr(image_cache, "read_split_images", no_decode)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="edge_sdk.image_cache"):
        again = load_dataset("folder", archive)
        test = load_dataset("folder", archive, split="test")
    assert torch.equal(again.x, first.x) and torch.equal(again.y, first.y) and again.class_names == CLASSES
    assert len(test) == 6 and f"decoded from the cache {files[0]}" in caplog.text
    assert files[0].stat().st_mtime_ns == written
    # another resize is another cache entry
    monkeypatch.undo()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert load_dataset("folder", archive, image_size=3).x.shape == (12, 3, 3, 3)
    # a changed source (another image, its size and time) is decoded again; its stale caches are removed
    folder = tmp_path / "photos"
    noise(99).save(folder / "train" / "bird" / "0000.png")
    make_tar(folder, archive)
    os.utime(archive, ns=(written + 10**9, written + 10**9))
    changed = load_dataset("folder", archive)
    assert not torch.equal(changed.x[0], first.x[0]) and torch.equal(changed.x[1:], first.x[1:])
    assert not files[0].exists() and len(list((tmp_path / "cache" / "images").glob("*.npz"))) == 2  # + size 3


def test_a_folder_source_is_keyed_by_its_files_and_a_broken_cache_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    folder = make_split_folder(tmp_path / "photos")
    before = partition_settings("folder", num_clients=2, alpha=1.0, seed=0, data_root=folder)
    load_dataset("folder", folder)
    (cache,) = (tmp_path / "cache" / "images").glob("*.npz")
    cache.write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger="edge_sdk.image_cache"):
        assert len(load_dataset("folder", folder)) == 12
    assert "is unreadable" in caplog.text and np.load(cache)["x_train"].shape == (12, 3, 5, 6)
    noise(3).save(folder / "test" / "cat" / "0009.png")  # one more test image
    after = partition_settings("folder", num_clients=2, alpha=1.0, seed=0, data_root=folder)
    assert before["source"] != after["source"] and before["source"]["files"] == 18
    assert len(load_dataset("folder", folder, split="test")) == 7


def test_cache_folder_follows_xdg_and_the_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert image_cache.cache_dir() == tmp_path / "mine" / "images"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert image_cache.cache_dir() == tmp_path / "xdg" / "oneshot-fl-edge" / "images"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert image_cache.cache_dir() == Path.home() / ".cache" / "oneshot-fl-edge" / "images"


# ---------------------------------------------------------------- edge-sdk partition


def test_partition_cli_on_a_folder_dataset(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = make_split_folder(tmp_path / "photos", train=6, test=2, suffix=".jpg")
    out = tmp_path / "parts"
    argv = ["partition", "--dataset", "folder", "--data-root", str(root), "--image-size", "4",
            "--num-clients", "2", "--alpha", "1", "--min-size", "1", "--out", str(out)]  # fmt: skip
    assert edge_main(argv) == 0
    manifest = json.loads((out / "partition.json").read_text())
    assert (
        manifest["dataset"] == "folder"
        and manifest["image_size"] == 4
        and manifest["input_shape"] == [3, 4, 4]
    )
    assert manifest["source"]["path"] == str(root.resolve()) and sum(manifest["sizes"]) == 18
    client = load_client_data(out / "client_00.npz")
    assert client.input_shape == (3, 4, 4) and client.class_names == CLASSES
    assert load_client_data(out / "test.npz").label_counts() == [2, 2, 2]
    capsys.readouterr()
    bad = root / "test" / "cat" / "0001.jpg"
    bad.write_bytes(b"")
    assert edge_main([*argv[:-1], str(tmp_path / "again")]) == 1
    err = capsys.readouterr().err
    *_, last = err.strip().splitlines()  # after the log line saying where the cache goes
    assert last.startswith(f"edge-sdk: error: cannot read image {bad} (0 bytes)") and "Traceback" not in err
    assert edge_main(["partition", "--dataset", "digits", *argv[5:]]) == 2  # --image-size with digits
    assert "image_size applies to the folder dataset" in capsys.readouterr().err
