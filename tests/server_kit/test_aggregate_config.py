"""AggregateConfig.from_dict (the inverse of to_dict) and `server-kit aggregate --config FILE` (a TOML file
or a server report.json, to replay it) with flags over the file, `--print-config`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest

from common.device import resolve_device
from common.errors import ConfigError
from edge_sdk.precision import resolve_precision
from server_kit.aggregate_config import AggregateConfig
from server_kit.cli import main
from server_kit.labelling.labels import LabelConfig
from server_kit.training.adversarial import AdversarialConfig
from server_kit.training.distill import DistillConfig
from server_kit.training.fusion import FusionConfig
from tests.server_kit.test_aggregate import bundles  # noqa: F401
from tests.server_kit.test_server_cli import TINY

CONFIGS = {
    "fast": AggregateConfig(),
    "paper": AggregateConfig.preset("paper", precision="fp32"),
    "fusion": AggregateConfig(
        synth=("decoder",),
        fusion=FusionConfig.preset("mnist", mode="sd"),
        decoder_temperature=0.9,
        decoder_weighting="federation",
    ),
    "mix": AggregateConfig(distill=DistillConfig(epochs=None, mix=0.5)),
    "adversarial": AggregateConfig(
        adversarial=AdversarialConfig(rounds=2),
        labels=LabelConfig(rule="mean"),
        threads=2,
        verify_claims=True,
    ),
}


def test_decoder_weighting_is_one_of_two():
    with pytest.raises(ConfigError, match="decoder_weighting must be 'examples' or 'federation'"):
        AggregateConfig(decoder_weighting="squared")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_from_dict_inverts_to_dict_with_the_precision_that_ran(name):
    config = CONFIGS[name]
    ran = replace(config, precision=resolve_precision(config.precision, resolve_device(config.device)))
    assert AggregateConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == ran


def test_a_toml_file_and_flags_over_it(tmp_path, capsys):
    toml = tmp_path / "server.toml"
    toml.write_text(
        'student = "C4k3-P-F16-F10"\nseed = 4\nsynth = ["inversion", "decoder"]\n[distill]\nepochs = 3\n'
        '[fusion]\nmode = "ce"\n',
        encoding="utf-8",
    )
    argv = ["aggregate", "a.bundle", "--out", str(tmp_path / "o"), "--config", str(toml), "--print-config"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["seed"] == 4 and printed["distill"]["epochs"] == 3
    assert printed["fusion"]["mode"] == "ce" and printed["distill"]["tau"] == 4.0
    # flags override the file; --fusion-epochs keeps the file's fusion mode
    assert main([*argv, "--seed", "0", "--distill-epochs", "7", "--fusion-epochs", "2"]) == 0
    over = json.loads(capsys.readouterr().out)
    assert over["seed"] == 0 and over["distill"]["epochs"] == 7 and over["fusion"]["epochs"] == 2
    assert over["fusion"]["mode"] == "ce" and over["student"] == "C4k3-P-F16-F10"
    toml.write_text('studnet = "C4k3-P-F16-F10"\n', encoding="utf-8")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "unknown keys ['studnet'] in config; valid keys are ['adversarial'," in err
    )


def test_an_aggregation_replays_from_its_report(tmp_path, bundles):  # noqa: F811
    assert main(["aggregate", *bundles, "--out", str(tmp_path / "run"), *TINY]) == 0
    report = str(tmp_path / "run" / "report.json")
    assert main(["aggregate", *bundles, "--out", str(tmp_path / "again"), "--config", report, "--quiet"]) == 0
    first, again = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("run", "again"))
    assert again["config"] == first["config"] and first["config"]["seed"] == 3  # TINY's, not the default
    digests = [
        hashlib.sha256((tmp_path / d / "global.onnx").read_bytes()).hexdigest() for d in ("run", "again")
    ]
    assert digests[0] == digests[1]


def test_auto_settings_are_decided_by_the_input_shape():
    """The student, the inversion's image priors, the mirrored views and the distillation's epochs follow
    the teachers' channels, never a dataset name: one channel keeps the small CNN, no priors, no views (the
    runs before these settings), three get the residual student, a shift of 1/8 of the side, the flip and
    the mirrors; mixtures only where asked for (and then half the color epochs); a setting given is kept
    as given."""
    from server_kit.aggregate_config import COLOR_STUDENT, DEFAULT_STUDENT
    from server_kit.training.distill import COLOR_EPOCHS, COLOR_MIX_EPOCHS

    gray, color = AggregateConfig().for_task((1, 28, 28)), AggregateConfig().for_task((3, 32, 32))
    assert gray.student == DEFAULT_STUDENT and (gray.inversion.jitter, gray.inversion.flip) == (0.0, False)
    assert color.student == COLOR_STUDENT and (color.inversion.jitter, color.inversion.flip) == (0.125, True)
    assert (gray.distill.epochs, color.distill.epochs) == (10, COLOR_EPOCHS)
    assert (gray.distill.mix, color.distill.mix) == (0.0, 0.0) and gray.distill.to_dict()["mix"] == 0
    given_mix = AggregateConfig(distill=replace(AggregateConfig().distill, mix=0.25))
    assert given_mix.for_task((1, 28, 28)).distill.mix == 0.25
    assert given_mix.for_task((3, 32, 32)).distill.epochs == COLOR_MIX_EPOCHS  # half: the votes cost a step
    assert AggregateConfig.from_dict(given_mix.for_task((3, 32, 32)).to_dict()).distill.mix == 0.25
    assert gray.synth is None and color.synth == ("inversion", "generator")
    assert (gray.views, color.views) == ("none", "flip")  # a mirrored digit is no digit
    assert AggregateConfig(views="none").for_task((3, 32, 32)).views == "none"  # given: kept
    with pytest.raises(ConfigError, match="views must be one of"):
        AggregateConfig(views="rotate")
    assert AggregateConfig(fusion=FusionConfig()).for_task((3, 32, 32)).synth is None  # FedMHO keeps them
    assert (
        AggregateConfig(distill=replace(AggregateConfig().distill, epochs=4))
        .for_task((3, 8, 8))
        .distill.epochs
        == 4
    )
    assert "jitter" not in gray.inversion.to_dict() and "flip" not in gray.inversion.to_dict()
    given = AggregateConfig(student="C8k3-P-F10", inversion=replace(AggregateConfig().inversion, flip=False))
    kept = given.for_task((3, 32, 32))
    assert kept.student == "C8k3-P-F10" and kept.inversion.flip is False and kept.inversion.jitter == 0.125
    replayed = AggregateConfig.from_dict(color.to_dict())  # a report replays (with the precision that ran)
    assert replace(replayed.for_task((3, 32, 32)), precision="auto") == color
    with pytest.raises(ConfigError, match="student must be 'auto' or an architecture spec"):
        AggregateConfig(student="nope")
