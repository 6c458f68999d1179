"""The server's phases one at a time: synthesize (sources + claim check), label, train_global."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from profiles.errors import ConfigError, DataError
from server_kit.aggregate import SOURCES, Federation, label, synthesize, train_global
from server_kit.labels import LabelConfig
from server_kit.teachers import load_teachers
from tests.server_kit.test_aggregate import SHAPE, L, bundles, tiny_config  # noqa: F401


@pytest.fixture(scope="module")
def fed(bundles) -> Federation:  # noqa: F811
    teachers, _ = load_teachers(bundles)
    return Federation.from_teachers(teachers, torch.device("cpu"))


def test_federation_reads_what_the_bundles_say(fed):
    assert len(fed.modules) == 3 and fed.num_classes == L and fed.input_shape == SHAPE
    assert fed.label_counts == [[10, 0, 5], [3, 7, 0], [4, 4, 4]]


def test_synthesize_pools_sources_in_registry_order(tmp_path, fed):
    config = tiny_config(synth=("generator", "inversion"), generator=_tiny_generator(), verify_claims=False)
    synthesis = synthesize(fed, config, tmp_path)
    assert list(synthesis.parts) == [s for s in SOURCES if s in config.synth] == ["inversion", "generator"]
    assert synthesis.report["synthetic_sources"] == {"inversion": 36, "generator": 10}
    assert len(synthesis.synthetic) == 46 and synthesis.report["claims"] is None
    assert synthesis.label_counts == fed.label_counts
    assert (synthesis.synthetic.teacher[36:] == -1).all()  # the generator's samples: the whole ensemble
    assert set(synthesis.seconds) == {"inversion", "generator"}


def test_synthesize_checks_claims_after_the_inversion(tmp_path, fed):
    synthesis = synthesize(fed, tiny_config(), tmp_path)  # verify_claims None: on with inversion
    claims = synthesis.report["claims"]
    assert set(claims) == {"rejected", "scores"} and "claims" in synthesis.seconds
    for k, c in claims["rejected"]:  # a rejected claim's count is 0 for every later phase
        assert synthesis.label_counts[k][c] == 0 and fed.label_counts[k][c] > 0
    with pytest.raises(ConfigError, match="add 'inversion'"):
        tiny_config(synth=("generator",), verify_claims=True)


def test_label_phase_uses_the_rule_and_the_trusted_counts(tmp_path, fed):
    config = tiny_config(
        verify_claims=False, labels=LabelConfig(rule="conditioned", mask=True, drop_mismatch=False)
    )
    synthesis = synthesize(fed, config, tmp_path)
    labels = label(fed, synthesis, config)
    assert labels.targets.shape == (36, L) and labels.keep.all()
    torch.testing.assert_close(labels.targets.sum(1), torch.ones(36))
    # class 1 is held by teachers 1 and 2 only: masked, teacher 0 never puts mass on it
    no_class_1 = dataclasses.replace(synthesis, label_counts=[[10, 0, 5], [3, 0, 0], [4, 0, 4]])
    assert label(fed, no_class_1, config).targets[:, 1].eq(0).all()
    hard = label(fed, synthesis, dataclasses.replace(config, hard_labels=True))
    assert hard.report == {"rule": "hard"} and torch.equal(
        hard.targets.argmax(1), synthesis.synthetic.target_class
    )


def test_constructed_samples_keep_their_class_and_the_vote_still_drops_them(tmp_path, fed):
    config = tiny_config(verify_claims=False)
    synthesis = synthesize(fed, config, tmp_path)
    n = len(synthesis.synthetic)
    # pretend the inversion part came from decoders: labelled by construction, kept by the teachers' vote
    as_decoded = dataclasses.replace(synthesis, parts={"decoder": synthesis.parts["inversion"]})
    voted = label(fed, synthesis, config)
    one_hot = dataclasses.replace(config, construction_labels=("decoder",), construction_weight=1.0)
    built = label(fed, as_decoded, one_hot)
    assert torch.equal(
        built.targets, torch.nn.functional.one_hot(synthesis.synthetic.target_class, L).float()
    )
    assert torch.equal(built.keep, voted.keep)  # drop_mismatch: the same samples go
    assert built.report["by_construction"] == n and built.report["by_construction_kept"] == int(
        voted.keep.sum()
    )
    blend = label(fed, as_decoded, dataclasses.replace(one_hot, construction_weight=0.25))
    torch.testing.assert_close(blend.targets, 0.25 * built.targets + 0.75 * voted.targets)
    kept_all = dataclasses.replace(one_hot, labels=LabelConfig(drop_mismatch=False))
    assert label(fed, as_decoded, kept_all).keep.all()
    with pytest.raises(ConfigError, match="construction_labels"):
        tiny_config(construction_labels=("decoders",))
    with pytest.raises(ConfigError, match="construction_weight"):
        tiny_config(construction_weight=1.5)


def test_train_global_distils_on_the_kept_samples_only(tmp_path, fed):
    config = tiny_config(verify_claims=False)
    synthesis = synthesize(fed, config, tmp_path)
    labels = label(fed, synthesis, config)
    training = train_global(fed, synthesis, labels, config)
    assert training.init == "consensus-distillation" and training.spec == "C4k3-P-F16-F3"
    assert len(training.distill_loss) == config.distill.epochs and not training.student.training
    none_kept = dataclasses.replace(labels, keep=torch.zeros_like(labels.keep))
    with pytest.raises(DataError, match="drop_mismatch=False"):
        train_global(fed, synthesis, none_kept, config)


def _tiny_generator():
    from server_kit.generator import GeneratorConfig

    return GeneratorConfig.preset(steps=2, batch_size=4, samples=10, width=4, nz=4)


def test_adversarial_rounds_refine_the_student_and_leave_the_generator_alone(tmp_path, fed):
    from server_kit.adversarial import AdversarialConfig

    rounds = AdversarialConfig(rounds=2, generator_steps=1, samples_per_round=8)
    config = tiny_config(synth=("inversion", "generator"), generator=_tiny_generator(), adversarial=rounds)
    synthesis = synthesize(fed, config, tmp_path)
    before = {k: v.clone() for k, v in synthesis.generator.state_dict().items()}
    training = train_global(fed, synthesis, label(fed, synthesis, config), config)
    assert set(training.adversarial) == {"student_loss", "adv", "kept"}
    assert len(training.adversarial["student_loss"]) == 2 and "adversarial" in training.seconds
    assert all(torch.equal(v, synthesis.generator.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ConfigError, match="add 'generator'"):
        tiny_config(adversarial=rounds)


def test_cli_flags_reach_the_label_trust_and_adversarial_options():
    from server_kit.cli import aggregate_config, build_parser

    args = build_parser().parse_args(
        [
            "aggregate", "a.bundle", "--out", "o", "--labels", "conditioned", "--label-mask",
            "--keep-mismatch", "--no-verify-claims", "--inversion-classes", "held", "--generator-mask",
            "--adversarial-rounds", "3", "--distill-shift", "0.1",
        ]
    )  # fmt: skip
    config = aggregate_config(args, seed=0)
    assert config.labels == LabelConfig(rule="conditioned", mask=True, drop_mismatch=False)
    assert config.verify_claims is False and not config.checks_claims
    assert config.inversion.classes == "held" and config.generator.mask_teachers
    assert config.adversarial is not None and config.adversarial.rounds == 3
    assert config.distill.shift == 0.1
    default = aggregate_config(build_parser().parse_args(["aggregate", "a.bundle", "--out", "o"]), seed=0)
    assert default.labels == LabelConfig() and default.checks_claims and default.adversarial is None
