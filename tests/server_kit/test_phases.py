"""The server's phases one at a time: synthesize (sources + claim check), label, train_global."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.errors import ConfigError, DataError
from server_kit.aggregate_config import AggregateConfig
from server_kit.labelling import Labels, label, top_up
from server_kit.labelling.labels import LabelConfig
from server_kit.synthesis import SOURCES, DecoderPool, Synthesis, SyntheticSet, synthesize
from server_kit.teachers import Federation
from server_kit.teachers.loading import load_teachers
from server_kit.training import Training, train_global
from tests.server_kit.test_aggregate import SHAPE, L, bundles, tiny_config  # noqa: F401


# each phase takes its own settings: these run it with those of an AggregateConfig, as the driver does
def _synthesize(fed: Federation, config: AggregateConfig, out) -> Synthesis:
    return synthesize(fed, config.synthesis_config(bool(fed.decoders)), out)


def _label(fed: Federation, synthesis: Synthesis, config: AggregateConfig) -> Labels:
    return label(fed, synthesis, config.labelling_config())


def _top_up(fed: Federation, synthesis: Synthesis, labels: Labels, config: AggregateConfig):
    return top_up(fed, synthesis, labels, config.labelling_config())


def _train_global(fed: Federation, synthesis: Synthesis, labels: Labels, config: AggregateConfig) -> Training:
    return train_global(fed, synthesis, labels, config.training_config())


@pytest.fixture(scope="module")
def fed(bundles) -> Federation:  # noqa: F811
    teachers, _ = load_teachers(bundles)
    return Federation.from_teachers(teachers, torch.device("cpu"))


def test_federation_reads_what_the_bundles_say(fed):
    assert len(fed.modules) == 3 and fed.num_classes == L and fed.input_shape == SHAPE
    assert fed.label_counts == [[10, 0, 5], [3, 7, 0], [4, 4, 4]]


def test_synthesize_pools_sources_in_registry_order(tmp_path, fed):
    config = tiny_config(synth=("generator", "inversion"), generator=_tiny_generator(), verify_claims=False)
    synthesis = _synthesize(fed, config, tmp_path)
    assert list(synthesis.parts) == [s for s in SOURCES if s in config.synth] == ["inversion", "generator"]
    assert synthesis.report["synthetic_sources"] == {"inversion": 36, "generator": 10}
    assert len(synthesis.synthetic) == 46 and synthesis.report["claims"] is None
    assert synthesis.label_counts == fed.label_counts
    assert (synthesis.synthetic.teacher[36:] == -1).all()  # the generator's samples: the whole ensemble
    assert set(synthesis.seconds) == {"inversion", "generator"}


def test_synthesize_checks_claims_after_the_inversion(tmp_path, fed):
    synthesis = _synthesize(fed, tiny_config(), tmp_path)  # verify_claims None: on with inversion
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
    synthesis = _synthesize(fed, config, tmp_path)
    labels = _label(fed, synthesis, config)
    assert labels.targets.shape == (36, L) and labels.keep.all()
    torch.testing.assert_close(labels.targets.sum(1), torch.ones(36))  # normalised rows: ulps of 1
    # class 1 is held by teachers 1 and 2 only: masked, teacher 0 never puts mass on it
    no_class_1 = dataclasses.replace(synthesis, label_counts=[[10, 0, 5], [3, 0, 0], [4, 0, 4]])
    assert _label(fed, no_class_1, config).targets[:, 1].eq(0).all()
    hard = _label(fed, synthesis, dataclasses.replace(config, hard_labels=True))
    assert hard.report == {"rule": "hard"} and torch.equal(
        hard.targets.argmax(1), synthesis.synthetic.target_class
    )


def test_constructed_samples_keep_their_class_and_the_vote_still_drops_them(tmp_path, fed):
    config = tiny_config(verify_claims=False)
    synthesis = _synthesize(fed, config, tmp_path)
    n = len(synthesis.synthetic)
    # pretend the inversion part came from decoders: labelled by construction, kept by the teachers' vote
    as_decoded = dataclasses.replace(synthesis, parts={"decoder": synthesis.parts["inversion"]})
    voted = _label(fed, synthesis, config)
    one_hot = dataclasses.replace(config, construction_labels=("decoder",), construction_weight=1.0)
    built = _label(fed, as_decoded, one_hot)
    assert torch.equal(  # weight 1 on a one-hot target and 0 on the vote: exact in IEEE arithmetic
        built.targets, torch.nn.functional.one_hot(synthesis.synthetic.target_class, L).float()
    )
    assert torch.equal(built.keep, voted.keep)  # drop_mismatch: the same samples go
    assert built.report["by_construction"] == n and built.report["by_construction_kept"] == int(
        voted.keep.sum()
    )
    blend = _label(fed, as_decoded, dataclasses.replace(one_hot, construction_weight=0.25))
    # the same two float32 products and a sum: the float32 defaults
    torch.testing.assert_close(blend.targets, 0.25 * built.targets + 0.75 * voted.targets)
    kept_all = dataclasses.replace(one_hot, labels=LabelConfig(drop_mismatch=False))
    assert _label(fed, as_decoded, kept_all).keep.all()
    with pytest.raises(ConfigError, match="construction_labels"):
        tiny_config(construction_labels=("decoders",))
    with pytest.raises(ConfigError, match="construction_weight"):
        tiny_config(construction_weight=1.5)


def test_train_global_distils_on_the_kept_samples_only(tmp_path, fed):
    config = tiny_config(verify_claims=False)
    synthesis = _synthesize(fed, config, tmp_path)
    labels = _label(fed, synthesis, config)
    training = _train_global(fed, synthesis, labels, config)
    assert training.init == "consensus-distillation" and training.spec == "C4k3-P-F16-F3"
    assert len(training.distill_loss) == config.distill.epochs and not training.student.training
    none_kept = dataclasses.replace(labels, keep=torch.zeros_like(labels.keep))
    with pytest.raises(DataError, match="drop_mismatch=False"):
        _train_global(fed, synthesis, none_kept, config)


def test_train_global_labels_the_mixtures_by_the_sets_vote(tmp_path, fed):
    from server_kit.training.adversarial import AdversarialConfig

    config = tiny_config(verify_claims=False)
    mix = tiny_config(verify_claims=False, distill=dataclasses.replace(config.distill, mix=0.5))
    synthesis = _synthesize(fed, config, tmp_path)
    labels = _label(fed, synthesis, config)
    plain, mixing = (_train_global(fed, synthesis, labels, c) for c in (config, mix))
    assert len(mixing.distill_loss) == config.distill.epochs
    assert mixing.distill_loss != plain.distill_loss  # the same seed: only the mixtures differ
    for clash, match in (
        (
            {"adversarial": AdversarialConfig(rounds=1), "synth": ("inversion", "generator")},
            "which adversarial",
        ),
        ({"labels": LabelConfig(rule="conditioned")}, "which labels.rule=conditioned"),
        ({"hard_labels": True}, "which hard_labels"),
    ):
        with pytest.raises(ConfigError, match=match):
            dataclasses.replace(mix, **clash)


def _tiny_generator():
    from server_kit.synthesis.generator import GeneratorConfig

    return GeneratorConfig.preset(steps=2, batch_size=4, samples=10, width=4, nz=4)


def test_adversarial_rounds_refine_the_student_and_leave_the_generator_alone(tmp_path, fed):
    from server_kit.training.adversarial import AdversarialConfig

    rounds = AdversarialConfig(rounds=2, generator_steps=1, samples_per_round=8)
    config = tiny_config(synth=("inversion", "generator"), generator=_tiny_generator(), adversarial=rounds)
    synthesis = _synthesize(fed, config, tmp_path)
    before = {k: v.clone() for k, v in synthesis.generator.state_dict().items()}
    training = _train_global(fed, synthesis, _label(fed, synthesis, config), config)
    assert set(training.adversarial) == {"student_loss", "adv", "kept"}
    assert len(training.adversarial["student_loss"]) == 2 and "adversarial" in training.seconds
    assert all(torch.equal(v, synthesis.generator.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ConfigError, match="add 'generator'"):
        tiny_config(adversarial=rounds)


def test_cli_flags_reach_the_label_trust_and_adversarial_options():
    from common.config_args import given_table
    from server_kit.cli import aggregate_config, build_parser

    def config_of(argv: list[str]):
        args = build_parser().parse_args(argv)
        return aggregate_config(args, given_table(args, args.flags))

    config = config_of(
        [
            "aggregate", "a.bundle", "--out", "o", "--labels-rule", "conditioned", "--labels-mask",
            "--no-labels-drop-mismatch", "--no-verify-claims", "--inversion-classes", "held",
            "--generator-mask-teachers", "--adversarial-rounds", "3", "--distill-shift", "0.1",
            "--no-labels-abstain", "--no-top-up",
        ]
    )  # fmt: skip
    assert config.labels == LabelConfig(rule="conditioned", mask=True, drop_mismatch=False, abstain=False)
    assert config.top_up is False
    assert config.verify_claims is False and not config.checks_claims
    assert config.inversion.classes == "held" and config.generator.mask_teachers
    assert config.adversarial is not None and config.adversarial.rounds == 3
    assert config.distill.shift == 0.1
    default = config_of(["aggregate", "a.bundle", "--out", "o"])
    assert default.labels == LabelConfig() and default.checks_claims and default.adversarial is None
    assert default.top_up and default.labels.abstain
    sim = build_parser().parse_args(["simulate", "--dataset", "digits", "--out", "o", "--unknown-output"])
    assert given_table(sim, sim.flags)["unknown_output"] is True


class _Brightness(torch.nn.Module):
    """A teacher that calls an image class c when its mean pixel is nearest (c + 1) / 4."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centres = torch.arange(1, L + 1, dtype=x.dtype) / 4
        return -100.0 * (x.flatten(1).mean(1, keepdim=True) - centres).square()


class _ShadeDecoder(torch.nn.Module):
    """A decoder whose class-c images have mean pixel (c + 1) / 4, with a little latent noise."""

    latent_dim, num_classes, output_shape = 2, L, SHAPE

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shade = (y.argmax(1).float() + 1) / 4 + 0.01 * z[:, 0]
        return shade.view(-1, 1, 1, 1).expand(-1, *SHAPE).contiguous()


def _toy_synthesis(pool_counts: list[list[int]]):
    """10 'inversion' samples per class, of which classes 1 and 2 are drawn as class 0 (the vote drops
    them), then 2 decoder samples per class."""

    y_inv = torch.arange(L).repeat_interleave(10)
    shade = torch.full((len(y_inv),), 0.25)
    x_inv = shade.view(-1, 1, 1, 1).expand(-1, *SHAPE).contiguous()
    y_dec = torch.arange(L).repeat_interleave(2)
    x_dec = _ShadeDecoder()(torch.zeros(len(y_dec), 2), torch.nn.functional.one_hot(y_dec, L).float())
    parts = {
        "inversion": SyntheticSet(x_inv, torch.zeros(len(y_inv), dtype=torch.long), y_inv),
        "decoder": SyntheticSet(x_dec, torch.full((len(y_dec),), -1), y_dec),
    }
    pooled = SyntheticSet(
        *(torch.cat([getattr(p, f) for p in parts.values()]) for f in ("x", "teacher", "target_class"))
    )
    counts = [[5, 5, 0], [0, 0, 5]]
    pool = DecoderPool([_ShadeDecoder(), _ShadeDecoder()], pool_counts)
    fed = Federation([_Brightness(), _Brightness()], counts, L, SHAPE, torch.device("cpu"))
    return fed, Synthesis(pooled, parts, counts, {}, {"synthetic_sources": {}}, None, pool)


def test_top_up_brings_classes_the_vote_thinned_out_to_the_median_with_decoder_samples():
    # decoders hold classes 0 and 2 only: class 2 can be topped up, class 1 cannot
    fed, synthesis = _toy_synthesis([[5, 0, 0], [0, 0, 5]])
    config = tiny_config(construction_weight=1.0)
    labels = _label(fed, synthesis, config)
    kept = torch.bincount(labels.targets.argmax(1)[labels.keep], minlength=L).tolist()
    assert kept == [12, 2, 2]  # the vote calls every 'inversion' image class 0
    grown, new = _top_up(fed, synthesis, labels, config)
    report = new.report["top_up"]
    assert report["goal"] == 2 and report["added"] == [0, 0, 0]  # the median class is already at 2

    # a federation where most classes are fine: the median is high, class 2 is short of it
    fed, synthesis = _toy_synthesis([[5, 0, 0], [0, 0, 5]])
    parts = dict(synthesis.parts)
    inv = parts["inversion"]
    fixed = inv.x.clone()
    fixed[inv.target_class == 1] = 0.5  # class 1's images now look like class 1
    parts["inversion"] = dataclasses.replace(inv, x=fixed)
    pooled = dataclasses.replace(synthesis.synthetic, x=torch.cat([fixed, parts["decoder"].x]))
    synthesis = dataclasses.replace(synthesis, synthetic=pooled, parts=parts)
    labels = _label(fed, synthesis, config)
    assert torch.bincount(labels.targets.argmax(1)[labels.keep], minlength=L).tolist() == [12, 12, 2]
    grown, new = _top_up(fed, synthesis, labels, config)
    report = new.report["top_up"]
    assert report["goal"] == 12 and report["drawn"][:2] == [0, 0] and report["drawn"][2] > 0
    assert report["added"] == [0, 0, 10]  # 13 drawn for 10 missing at the first samples' rate 0.8
    after = torch.bincount(new.targets.argmax(1)[new.keep], minlength=L).tolist()
    assert after == [12, 12, 12] and new.report["kept"] == 36
    # the pooled set is still the parts in order, the labels row-aligned with it
    assert torch.equal(grown.synthetic.x, torch.cat([p.x for p in grown.parts.values()]))
    assert len(new.targets) == len(new.keep) == len(grown.synthetic) == 30 + 6 + 10
    assert (grown.parts["decoder"].target_class[6:] == 2).all()
    assert grown.report["synthetic_sources"] == {"inversion": 30, "decoder": 16}
    again = _top_up(fed, synthesis, labels, config)[0]  # seeded: the same draw
    assert torch.equal(again.synthetic.x, grown.synthetic.x)
    # off, or without decoders: the inputs come back
    assert _top_up(fed, synthesis, labels, dataclasses.replace(config, top_up=False)) == (synthesis, labels)
    no_pool = dataclasses.replace(synthesis, decoders=None)
    assert _top_up(fed, no_pool, labels, config) == (no_pool, labels)
    with pytest.raises(ConfigError, match="top_up"):
        tiny_config(top_up=1)
