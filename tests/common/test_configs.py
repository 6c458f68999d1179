"""common.configs: a frozen config from a dict (the inverse of to_dict) and config files (TOML, JSON)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from common.configs import config_from_dict, read_config_file
from common.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Inner:
    steps: int
    lr: float = 0.1
    betas: tuple[float, ...] = (0.1, 1.0)


@dataclass(frozen=True, kw_only=True)
class Outer:
    name: str
    path: Path | None = None
    inner: Inner = field(default_factory=lambda: Inner(steps=5))
    extra: Inner | None = None
    sources: tuple[str, ...] | None = None


def test_nested_tables_build_nested_configs_over_the_field_default():
    config = config_from_dict(Outer, {"name": "a", "inner": {"lr": 0.5}}, what="config")
    # steps (required in Inner) comes from the field's default Inner(steps=5): only lr changed
    assert config == Outer(name="a", inner=Inner(steps=5, lr=0.5))


def test_json_and_toml_types_come_back():
    data = {"name": "a", "path": "x/y", "inner": {"steps": 2, "betas": [0.5]}, "sources": ["p", "q"]}
    config = config_from_dict(Outer, data, what="config")
    assert config.path == Path("x/y") and config.inner.betas == (0.5,) and config.sources == ("p", "q")
    nulls = {"name": "a", "path": None, "sources": None}
    assert config_from_dict(Outer, nulls, what="config") == Outer(name="a")


def test_an_optional_nested_config_without_a_default_builds_from_its_class():
    config = config_from_dict(Outer, {"name": "a", "extra": {"steps": 3}}, what="config")
    assert config.extra == Inner(steps=3)
    with pytest.raises(ConfigError, match=r"config.extra needs the keys \['steps'\], got \['lr'\]"):
        config_from_dict(Outer, {"name": "a", "extra": {"lr": 1.0}}, what="config")


def test_unknown_keys_are_refused_with_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown keys \['nme'\] in config; valid keys are \['extra', "):
        config_from_dict(Outer, {"nme": "a"}, what="config")
    with pytest.raises(ConfigError, match=r"unknown keys \['step'\] in config.inner; valid keys are"):
        config_from_dict(Outer, {"name": "a", "inner": {"step": 1}}, what="config")
    with pytest.raises(ConfigError, match=r"config\.inner must be a table of keys, got int"):
        config_from_dict(Outer, {"name": "a", "inner": 3}, what="config")


def test_a_base_fills_the_keys_left_out_and_builders_build_their_field():
    base = Outer(name="a", sources=("p",))
    built = config_from_dict(
        Outer, {"inner": {"steps": 9}}, what="config", base=base, builders={"name": lambda v, cur: cur + "!"}
    )
    assert built == Outer(name="a", sources=("p",), inner=Inner(steps=9))
    named = config_from_dict(Outer, {"name": "b"}, what="config", builders={"name": lambda v, cur: v * 2})
    assert named.name == "bb"


def test_config_files(tmp_path):
    toml = tmp_path / "a.toml"
    toml.write_text('name = "a"\n[inner]\nsteps = 2\n', encoding="utf-8")
    assert read_config_file(toml) == {"name": "a", "inner": {"steps": 2}}
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"config": {"name": "b"}, "global_accuracy": 0.5}), encoding="utf-8")
    assert read_config_file(results) == {"name": "b"}  # a run's results: its config entry
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"name": "c"}), encoding="utf-8")
    assert read_config_file(bare) == {"name": "c"}
    (tmp_path / "a.yaml").write_text("name: a\ninner:\n  lr: 1e-3\n  betas: [0.1, 1]\n", encoding="utf-8")
    # 1e-3 is a number, as in TOML (PyYAML's own loader reads YAML 1.1's "1e-3" as a string)
    assert read_config_file(tmp_path / "a.yaml") == {"name": "a", "inner": {"lr": 0.001, "betas": [0.1, 1]}}
    (tmp_path / "bad.yml").write_text("name: [a", encoding="utf-8")
    with pytest.raises(ConfigError, match="does not parse"):
        read_config_file(tmp_path / "bad.yml")
    (tmp_path / "a.ini").write_text("name = a", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"must end in \.toml, \.yaml, \.yml or \.json"):
        read_config_file(tmp_path / "a.ini")
    (tmp_path / "bad.toml").write_text("name = ", encoding="utf-8")
    with pytest.raises(ConfigError, match="does not parse"):
        read_config_file(tmp_path / "bad.toml")
    with pytest.raises(ConfigError, match="cannot read config file"):
        read_config_file(tmp_path / "missing.toml")
    (tmp_path / "list.json").write_text("[1]", encoding="utf-8")
    with pytest.raises(ConfigError, match="must hold a table of keys, got list"):
        read_config_file(tmp_path / "list.json")
