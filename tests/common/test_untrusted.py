"""Issue #34, class 5 and the shared helpers: config files are bounded regular UTF-8 files read into
bounded trees, and every decoded tree is checked for depth, key types and integer size without
recursion. Special files are refused before they are opened for reading, so nothing hangs."""

import dataclasses
import math
import os

import pytest

from common.checks import check_tree, is_number, load_json, load_toml, read_regular_file
from common.configs import config_from_dict, read_config_file
from common.errors import ConfigError, DataError

DEEP = "[" * 5000 + "]" * 5000
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"a": {1: 2}}, "map key must be a str"),
        ({"a": {b"k": 2}}, "map key must be a str"),
        ([[[[[1]]]]], "nested at most 3"),
        ({"n": 2**64}, "64 bits"),
        ({"n": -(2**63) - 1}, "64 bits"),
    ],
)
def test_check_tree_refuses(value, match):
    with pytest.raises(ConfigError, match=match):
        check_tree(value, "x", max_depth=3)


def test_check_tree_counts_shared_containers_once_per_use():
    shared = [1] * 10
    check_tree([shared] * 10, "x", max_nodes=111)
    with pytest.raises(ConfigError, match="at most 110 values"):
        check_tree([shared] * 10, "x", max_nodes=110)
    deep: object = 1
    for _ in range(100_000):  # deeper than the interpreter's stack: the walk does not recurse
        deep = [deep]
    with pytest.raises(ConfigError, match="nested"):
        check_tree(deep, "x")


@pytest.mark.parametrize(
    "text",
    [DEEP, '{"a": ' + "1" * 5000 + "}", '{"a": NaN}', '{"a": -Infinity}', '{"a": 1e999}', "{", b"\xff"],
)
def test_load_json_refuses(text):
    with pytest.raises(DataError):
        load_json(text, "x", error=DataError)


def test_load_json_and_toml_read_honest_text():
    assert load_json('{"a": [1, 2.5, "s", null, true]}', "x") == {"a": [1, 2.5, "s", None, True]}
    assert load_toml("a = [1, 2]\n[t]\nb = 'c'\n", "x") == {"a": [1, 2], "t": {"b": "c"}}
    with pytest.raises(ConfigError, match="nested"):
        load_toml("x = " + DEEP, "x")
    with pytest.raises(ConfigError, match="TOML"):
        load_toml("x = " + "9" * 5000, "x")


def test_is_number_takes_ints_past_float_range():
    assert is_number(10**400) and not is_number(math.inf) and not is_number(True)


def test_read_regular_file_refuses_special_files_links_and_large_files(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="regular file"):
        read_regular_file(fifo, max_bytes=10, what="f")  # a FIFO's open would block: it must not
    with pytest.raises(ConfigError, match="regular file"):
        read_regular_file("/dev/zero", max_bytes=10, what="f")
    big = tmp_path / "big"
    with open(big, "wb") as fh:
        fh.truncate(1 << 30)  # sparse: nothing is read from it
    with pytest.raises(ConfigError, match="at most 10 bytes"):
        read_regular_file(big, max_bytes=10, what="f")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "file")
    (tmp_path / "file").write_bytes(b"abc")
    assert read_regular_file(link, max_bytes=10, what="f") == b"abc"  # a link the user gave is theirs
    with pytest.raises(ConfigError, match="symbolic link"):
        read_regular_file(link, max_bytes=10, what="f", follow_links=False)


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("bomb.yaml", BOMB.encode(), "at most 100000 values"),
        ("deep.yaml", ("x: " + DEEP).encode(), "nested|parse"),
        ("deep.json", DEEP.encode(), "nested"),
        ("deep.toml", ("x = " + DEEP).encode(), "nested"),
        ("bad.toml", b"seed = 1\n# \xff\xfe\n", "UTF-8"),
        ("bad.json", b'{"seed": 1, "x": "\xff"}', "UTF-8"),
        ("big.json", b'{"seed": ' + b"9" * 5000 + b"}", "64 bits"),
    ],
)
def test_hostile_config_files_are_refused(tmp_path, name, content, match):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError, match=match):
        read_config_file(tmp_path / name)


def test_special_config_files_are_refused_without_reading(tmp_path):
    os.mkfifo(tmp_path / "fifo.toml")
    (tmp_path / "zero.toml").symlink_to("/dev/zero")
    for name in ("fifo.toml", "zero.toml"):
        with pytest.raises(ConfigError, match="regular file"):
            read_config_file(tmp_path / name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
    lr: float = 0.1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer:
    inner: Inner = dataclasses.field(default_factory=Inner)


@pytest.mark.parametrize("value", [[1, 2], "x", 5])
def test_a_wrong_container_for_a_nested_config_is_a_config_error(value):
    with pytest.raises(ConfigError, match="must be a table"):
        config_from_dict(Outer, {"inner": value}, what="outer")
