"""Pooled synthesis sources in `aggregate`: inversion, generator, or both."""

import json

import pytest
import torch

from common.errors import ConfigError
from server_kit.aggregate import aggregate
from server_kit.aggregate_config import AggregateConfig
from server_kit.synthesis import Synthesis, SyntheticSet, with_views
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


def test_mirrored_views_double_every_source_and_are_labelled_by_the_vote(tmp_path, bundles):  # noqa: F811
    """``views="flip"`` doubles every source, and the vote labels every sample of the doubled set (the
    mirrors are samples of their own, not copies of their images' targets)."""
    config = tiny_config(synth="inversion,generator", generator=TINY_GENERATOR, views="flip")
    result = aggregate(bundles, tmp_path, config=config)
    report = json.loads(result.report_path.read_text())
    assert report["config"]["views"] == "flip"
    assert report["synthetic_sources"] == {"inversion": 72, "generator": 40}
    assert result.synthetic_size == 112 and sum(report["labels"]["made_per_class"]) == 112


def test_with_views_keeps_parts_in_order():
    """Each part is followed by its own mirrors, so the pooled set stays the parts in order (what the
    construction labels and the top-up index by); a mirror keeps its image's teacher and class."""

    def part(start: int, n: int) -> SyntheticSet:
        x = torch.arange(start, start + n * 4, dtype=torch.float32).view(n, 1, 2, 2)
        return SyntheticSet(x=x, teacher=torch.arange(n), target_class=torch.full((n,), start))

    parts = {"inversion": part(0, 3), "generator": part(100, 2)}
    pooled = SyntheticSet(
        x=torch.cat([p.x for p in parts.values()]),
        teacher=torch.cat([p.teacher for p in parts.values()]),
        target_class=torch.cat([p.target_class for p in parts.values()]),
    )
    synthesis = Synthesis(pooled, parts, [[1]], {}, {"synthetic_sources": {"inversion": 3, "generator": 2}})
    assert with_views(synthesis, "none") is synthesis
    viewed = with_views(synthesis, "flip")
    assert viewed.report["synthetic_sources"] == {"inversion": 6, "generator": 4}
    inv = viewed.synthetic.x[:6]
    assert torch.equal(inv[:3], parts["inversion"].x) and torch.equal(inv[3:], parts["inversion"].x.flip(3))
    assert torch.equal(viewed.synthetic.x[6:8], parts["generator"].x)
    assert viewed.synthetic.teacher.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 0, 1]
    assert viewed.synthetic.target_class.tolist() == [0] * 6 + [100] * 4
    with pytest.raises(ConfigError, match="views must be one of"):
        with_views(synthesis, "auto")
