"""Issue #34, class 5 for profile files: read as bounded regular UTF-8 TOML, refused with ProfileError."""

import os

import pytest

from common.errors import ProfileError
from profiles import load_profile


@pytest.mark.parametrize(
    "content",
    [b"name = 'x'\n# \xff\xfe\n", b"x = " + b"[" * 5000 + b"]" * 5000, b"memory_mb = " + b"9" * 5000],
)
def test_hostile_profile_files_are_refused(tmp_path, content):
    (tmp_path / "p.toml").write_bytes(content)
    with pytest.raises(ProfileError):
        load_profile(tmp_path / "p.toml")


def test_special_profile_files_are_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fifo.toml")
    (tmp_path / "zero.toml").symlink_to("/dev/zero")
    for name in ("fifo.toml", "zero.toml"):
        with pytest.raises(ProfileError):
            load_profile(tmp_path / name)
