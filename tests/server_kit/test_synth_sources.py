"""Pooled synthesis sources in `aggregate`: inversion, generator, or both."""

import json

import pytest

from common.errors import ConfigError
from server_kit.aggregate import aggregate
from server_kit.aggregate_config import AggregateConfig
from server_kit.synthesis.generator import GeneratorConfig
from tests.server_kit.test_aggregate import bundles, tiny_config  # noqa: F401  (fixture reuse)

TINY_GENERATOR = GeneratorConfig.preset("fast", nz=8, width=8, steps=3, batch_size=8, samples=20)


@pytest.mark.parametrize(
    ("synth", "sizes"),
    [(("generator",), {"generator": 20}), ("inversion,generator", {"inversion": 36, "generator": 20})],
)
def test_sources_are_pooled(tmp_path, bundles, synth, sizes):  # noqa: F811
    config = tiny_config(synth=synth, generator=TINY_GENERATOR)
    result = aggregate(bundles, tmp_path, config=config)
    report = json.loads(result.report_path.read_text())
    assert report["synthetic_sources"] == sizes
    assert result.synthetic_size == sum(sizes.values())
    assert report["config"]["synth"] == list(config.synth)
    assert ("generator" in sizes) == (tmp_path / "generator" / "generator.onnx").is_file()
    assert ("inversion" in sizes) == (tmp_path / "synthetic").is_dir()


@pytest.mark.parametrize("synth", [(), ("inversion", "inversion"), ("decoder-x",), "inversion,nope"])
def test_bad_sources_are_refused(synth):
    with pytest.raises(ConfigError, match="synth must be"):
        AggregateConfig(synth=synth)
