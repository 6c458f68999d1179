"""Labelling synthetic samples: consensus rules, class shares, masks and the conditioning weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.errors import ConfigError, DataError
from edge_sdk.models.arch import build_model
from server_kit.labelling.labels import (
    LabelConfig,
    check_label_counts,
    class_shares,
    consensus,
    held_classes,
    label_synthetic,
    unconditioned_vote,
)
from server_kit.teachers import unpaired_counts
from tests.server_kit.test_distill import SHAPE, L, images, teachers


class ConstantLogits(nn.Module):
    """A teacher that says the same thing about every image."""

    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.register_buffer("logits", torch.tensor(logits))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(x.shape[0], -1)


# ----------------------------------------------------------------------------------------- consensus


def test_consensus_is_the_mean_of_teacher_probabilities():
    ts, x = teachers(), images(37)
    with torch.no_grad():
        manual = sum(F.softmax(t(x) / 4.0, dim=1) for t in ts) / 3  # 37 x 3
    got = consensus(ts, x, tau=4.0, batch_size=10, precision="fp32")  # several batches, one partial
    # the same float32 ops on probabilities below 1; batching can change GEMM blocking: ~1e-7 per value
    torch.testing.assert_close(got, manual, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.sum(1), torch.ones(37))


def test_consensus_in_bfloat16_stays_close_to_float32():
    ts, x = teachers(), images(37)
    exact = consensus(ts, x, tau=4.0, precision="fp32")
    fast = consensus(ts, x, tau=4.0, precision="bf16")  # emulated where the CPU has no bfloat16
    # bfloat16 keeps 8 significant bits (2**-9 ~ 2e-3 relative per rounding); 2e-2 on a probability allows
    # about ten such roundings, whether the CPU accumulates in float32 (native) or rounds each op (emulated)
    torch.testing.assert_close(fast, exact, atol=2e-2, rtol=0)
    torch.testing.assert_close(fast.sum(1), torch.ones(37))


def test_consensus_temperature_softens():
    ts, x = teachers(), images(20)
    sharp = consensus(ts, x, tau=1.0).max(1).values.mean()
    soft = consensus(ts, x, tau=20.0).max(1).values.mean()
    assert soft < sharp


def test_class_shares_and_held_classes():
    w = class_shares([[10, 0, 0], [30, 5, 0]])
    expected = torch.tensor([[0.25, 0.0, 0.5], [0.75, 1.0, 0.5]])  # no one has class 2: uniform
    torch.testing.assert_close(w, expected)
    held = held_classes([[10, 0, 0], [30, 5, 0], [0, 0, 0]])  # a teacher with no counts holds all
    assert held.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    with pytest.raises(ConfigError, match=">= 0"):
        class_shares([[1, -1, 0]])


def test_federation_shares_count_the_devices_that_sent_only_a_decoder():
    counts = [[10, 0, 0], [30, 5, 0]]
    w = class_shares(counts, others=[[40, 5, 0]])  # a wearable holding as many 0s as both classifiers
    expected = torch.tensor([[0.125, 0.0, 0.5], [0.375, 0.5, 0.5]])  # class 2: still uniform
    torch.testing.assert_close(w, expected)
    torch.testing.assert_close(class_shares(counts, others=[]), class_shares(counts))
    with pytest.raises(ConfigError, match="others must be K x L"):
        class_shares(counts, others=[[1, 1]])


def test_unpaired_counts_leave_out_a_classifier_devices_own_decoder():
    classifiers = [[10, 0, 5], [0, 4, 5]]
    decoders = [[10, 0, 5], [10, 0, 0], [0, 6, 1], [0, 0, 0]]
    # the same claim, the same claim with class 2 refused, another device, a decoder with every claim refused
    assert unpaired_counts(classifiers, decoders) == [[0, 6, 1]]
    assert unpaired_counts(classifiers, []) == []


def test_label_config_refuses_an_unknown_share_base():
    with pytest.raises(ConfigError, match="shares must be one of"):
        LabelConfig(shares="devices")  # type: ignore[arg-type]


def test_check_label_counts_is_the_one_validator_of_claimed_counts():
    counts = check_label_counts(((3, 0, 1), (0, 2, 2)), num_classes=3)
    assert counts.dtype == torch.float64 and counts.tolist() == [[3, 0, 1], [0, 2, 2]]
    assert check_label_counts((), num_classes=3, min_rows=0).shape == (0, 3)  # no decoders
    with pytest.raises(ConfigError, match="K >= 1"):
        check_label_counts(())
    with pytest.raises(DataError, match=r"decoder_counts must be K x L with K >= 1, L == 3"):
        check_label_counts([[1, 1]], num_classes=3, what="decoder_counts", error=DataError)
    with pytest.raises(ConfigError, match="K x L numbers"):
        check_label_counts([[1, 1], [1]])
    with pytest.raises(ConfigError, match="finite"):
        check_label_counts([[1, float("nan")]])


def test_label_weighted_consensus_ignores_a_teacher_for_classes_it_never_saw():
    # teacher 0 is sure of class 1 but has no examples of it; teachers 1 and 2 are uniform
    ts = [ConstantLogits([0.0, 10.0, 0.0]), ConstantLogits([0.0] * 3), ConstantLogits([0.0] * 3)]
    w = class_shares([[5, 0, 5], [5, 5, 5], [5, 5, 5]])
    x = images(4)
    a = 1.0 / (2.0 + torch.e**10)  # teacher 0's probability of classes 0 and 2
    raw = torch.tensor([(a + 2 / 3) / 3, 0.5 / 3 + 0.5 / 3, (a + 2 / 3) / 3])  # class 1: teachers 1, 2 only
    # closed forms vs a softmax of constant logits: a few float32 roundings, the float32 defaults
    torch.testing.assert_close(consensus(ts, x, tau=1.0, class_weights=w), (raw / raw.sum()).expand(4, -1))
    # unweighted, teacher 0's confident vote for class 1 counts fully
    mean = torch.tensor([(a + 2 / 3) / 3, (1 - 2 * a + 2 / 3) / 3, (a + 2 / 3) / 3])
    torch.testing.assert_close(consensus(ts, x, tau=1.0), mean.expand(4, -1))


def test_federation_shares_take_a_lone_holders_full_weight_away():
    # teacher 0 is the only classifier with 1s and calls every image a 1; teacher 1 holds the 0s, less sure
    ts = [ConstantLogits([0.0, 3.0, 0.0]), ConstantLogits([2.0, 0.0, 0.0])]
    counts, wearable = [[0, 100, 0], [100, 0, 0]], [[0, 300, 0]]  # a device that sent only a decoder
    x, y = images(4), torch.zeros(4, dtype=torch.long)
    plain = LabelConfig(drop_mismatch=False)
    alone = label_synthetic(ts, x, y, counts, config=plain, tau=1.0, decoder_only_counts=wearable)
    assert alone.targets.argmax(1).tolist() == [1] * 4  # "classifiers": the wearable's 1s are ignored
    config = LabelConfig(drop_mismatch=False, shares="federation")
    shared = label_synthetic(ts, x, y, counts, config=config, tau=1.0, decoder_only_counts=wearable)
    assert shared.targets.argmax(1).tolist() == [0] * 4  # teacher 0 now holds a quarter of the 1s


def test_consensus_validation():
    ts, x = teachers(), images(4)
    with pytest.raises(ConfigError, match="at least one teacher"):
        consensus([], x, tau=1.0)
    with pytest.raises(ConfigError, match="rows"):
        consensus(ts, x, tau=1.0, class_weights=torch.ones(2, L))
    with pytest.raises(ConfigError, match="classes"):
        consensus([*ts, build_model("C4k3-P-F4", SHAPE, 4)], x, tau=1.0)


# ----------------------------------------------------------------------------------------- conditioned


def test_a_teacher_with_no_example_of_y_has_zero_weight_on_samples_made_for_y():
    # teacher 0 never saw class 2 and says "class 2" loudly; teacher 1 alone holds class 2
    loud = ConstantLogits([0.0, 0.0, 20.0])
    owner = ConstantLogits([1.0, 0.0, 3.0])
    counts = [[50, 50, 0], [0, 10, 10]]
    x, y = images(4), torch.tensor([2, 2, 2, 2])
    config = LabelConfig(rule="conditioned", mask=False, drop_mismatch=False)
    got = label_synthetic([loud, owner], x, y, counts, config=config, tau=1.0)
    # weight 0 times the loud teacher plus weight 1 times the owner: the float32 defaults cover the roundings
    torch.testing.assert_close(got.targets, F.softmax(torch.tensor([1.0, 0.0, 3.0]), 0).expand(4, -1))
    # moving the non-owner's logits changes nothing on samples made for class 2
    other = label_synthetic([ConstantLogits([9.0, -9.0, 0.0]), owner], x, y, counts, config=config, tau=1.0)
    torch.testing.assert_close(other.targets, got.targets)


def test_samples_of_a_class_one_client_alone_holds_are_labelled_as_that_class():
    # class 2 lives on teacher 2 only; every other teacher, unmasked, would call the images class 0
    ts = [ConstantLogits([8.0, 0.0, 0.0]), ConstantLogits([8.0, 2.0, 0.0]), ConstantLogits([0.0, 3.0, 5.0])]
    counts = [[100, 20, 0], [80, 90, 0], [0, 3, 40]]
    x, y = images(6), torch.tensor([2, 2, 2, 0, 1, 2])
    plain = LabelConfig(rule="mean", mask=False, drop_mismatch=False)
    mean = label_synthetic(ts, x, y, counts, config=plain, tau=1.0)
    assert (mean.targets.argmax(1)[y == 2] != 2).all()  # the mean loses the class ...
    default = label_synthetic(ts, x, y, counts, config=LabelConfig(), tau=1.0)
    # label-weighted calls the class-2 samples (and the one class-1 sample) class 0: their owners label them
    assert default.report["conditioned_fallback_classes"] == [1, 2]
    for config in (LabelConfig(rule="conditioned", mask=True), LabelConfig()):  # the default too
        kept = label_synthetic(ts, x, y, counts, config=config, tau=1.0)
        assert (kept.targets.argmax(1)[y == 2] == 2).all()  # ... the conditioned and default rules keep it
        assert kept.keep[y == 2].all()
    cond = label_synthetic(ts, x, y, counts, config=LabelConfig(rule="conditioned", mask=True), tau=1.0)
    assert cond.report["made_per_class"] == [1, 1, 4] and cond.report["agree_per_class"][2] == 4


def test_mask_restricts_each_teacher_to_its_classes_and_drop_mismatch_filters():
    # teacher 0 holds classes 0, 1 but its arbitrary logit for class 2 is the largest
    ts = [ConstantLogits([2.0, 0.0, 9.0])]
    counts = [[10, 10, 0]]
    x, y = images(2), torch.tensor([0, 1])
    masked = label_synthetic(ts, x, y, counts, config=LabelConfig(rule="mean", mask=True), tau=1.0)
    assert masked.targets[:, 2].eq(0).all()
    # softmax with -inf: the same elementwise float32 ops, the float32 defaults
    torch.testing.assert_close(masked.targets[0], F.softmax(torch.tensor([2.0, 0.0, -torch.inf]), 0))
    assert masked.keep.tolist() == [True, False]  # the sample made for class 1 is labelled 0: dropped
    kept = label_synthetic(
        ts, x, y, counts, config=LabelConfig(rule="mean", mask=True, drop_mismatch=False), tau=1.0
    )
    assert kept.keep.all() and kept.kept == 2


def test_label_rules_reduce_to_consensus_on_real_style_rules():
    ts, x = teachers(), images(9)
    counts = [[5, 5, 5], [1, 0, 9], [3, 3, 0]]
    y = torch.zeros(9, dtype=torch.long)
    no = {"mask": False, "drop_mismatch": False}
    mean = label_synthetic(ts, x, y, counts, config=LabelConfig(rule="mean", **no), tau=2.0)
    # two code paths over the same teachers' outputs: weighting order differs by ulps, the float32 defaults
    torch.testing.assert_close(mean.targets, consensus(ts, x, tau=2.0))
    lw = label_synthetic(ts, x, y, counts, config=LabelConfig(rule="label-weighted", **no), tau=2.0)
    torch.testing.assert_close(lw.targets, consensus(ts, x, tau=2.0, class_weights=class_shares(counts)))


def test_the_vote_on_mixtures_is_the_sets_rule_without_a_class():
    ts, x = teachers(), images(9)
    counts = [[5, 5, 5], [1, 0, 9], [3, 3, 0]]
    y = torch.zeros(9, dtype=torch.long)
    for rule in ("mean", "label-weighted"):
        for mask in (False, True):
            config = LabelConfig(rule=rule, mask=mask, drop_mismatch=False)
            vote = unconditioned_vote(ts, x, counts, config=config, tau=2.0)
            made_for_y = label_synthetic(ts, x, y, counts, config=config, tau=2.0)
            torch.testing.assert_close(vote, made_for_y.targets)  # neither rule reads the class
    with pytest.raises(ConfigError, match="conditioned"):
        unconditioned_vote(ts, x, counts, config=LabelConfig(rule="conditioned"), tau=2.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"rule": "median"}, "rule"), ({"mask": 1}, "mask"), ({"drop_mismatch": "yes"}, "drop_mismatch")],
)
def test_label_config_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LabelConfig(**kwargs)


def test_label_synthetic_validation():
    ts, x = teachers(), images(3)
    with pytest.raises(ConfigError, match="rows"):
        label_synthetic(ts, x, torch.zeros(3, dtype=torch.long), [[1, 1, 1]], config=LabelConfig(), tau=1.0)
    with pytest.raises(ConfigError, match="target_class"):
        label_synthetic(ts, x, torch.tensor([0, 1, 3]), [[1, 1, 1]] * 3, config=LabelConfig(), tau=1.0)


# ------------------------------------------------------------------------- teachers that can abstain


def test_a_teacher_that_says_unknown_loses_its_vote_on_that_sample():
    from server_kit.teachers.abstain import Abstaining

    # teacher 0 holds classes 0 and 1 and calls everything class 0, but its "unknown" output (the 4th)
    # says the first two images are not its own; teacher 1 holds class 2 and calls everything class 2,
    # less sure than teacher 0
    class Unsure(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            unknown = torch.tensor([9.0, 9.0, -9.0, -9.0])[: x.shape[0]]
            known = torch.tensor([6.0, 0.0, 0.0]).expand(x.shape[0], -1)
            return torch.cat([known, unknown.unsqueeze(1)], dim=1)

    abstaining, owner = Abstaining(Unsure(), L), ConstantLogits([0.0, 0.0, 3.0])
    counts = [[50, 50, 0], [0, 0, 50]]
    x, y = images(4), torch.tensor([2, 2, 0, 0])
    config = LabelConfig(drop_mismatch=False)
    got = label_synthetic([abstaining, owner], x, y, counts, config=config, tau=1.0)
    assert got.targets.argmax(1).tolist() == [2, 2, 0, 0]
    p_own = 1 - torch.sigmoid(9.0 - torch.logsumexp(torch.tensor([6.0, 0.0, 0.0]), 0))
    assert float(got.targets[0, 0]) < 2 * float(p_own)  # its vote scaled by p_own ~ 0.05
    ignored = label_synthetic(
        [abstaining, owner], x, y, counts, config=LabelConfig(drop_mismatch=False, abstain=False), tau=1.0
    )
    assert ignored.targets.argmax(1).tolist() == [0, 0, 0, 0]  # the louder teacher wins everywhere
    # the ensemble of real images weighs it the same way; a plain teacher is untouched
    weights = class_shares(counts)
    real = consensus([abstaining, owner], x, tau=1.0, class_weights=weights)
    # the same weighted mean of probabilities in another order: ulps of values below 1
    torch.testing.assert_close(real, got.targets, atol=1e-6, rtol=0)
    plain = consensus([owner, owner], x, tau=1.0)
    torch.testing.assert_close(plain, consensus([owner, owner], x, tau=1.0, abstain=False))
    with pytest.raises(ConfigError, match="abstain"):
        LabelConfig(abstain=1)


def test_a_sample_every_teacher_disowns_still_gets_a_target():
    from server_kit.teachers.abstain import MIN_OWN, Abstaining

    class Disowns(nn.Module):  # "unknown" by a margin no float32 softmax can tell from certainty
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tensor([3.0, 0.0, 0.0, 200.0]).expand(x.shape[0], -1)

    teacher = Abstaining(Disowns(), L)
    own = teacher.split(images(2))[1]
    # MIN_OWN is a clamp, so the value is exact
    assert own.dtype == torch.float64 and torch.equal(own, torch.full((2,), MIN_OWN, dtype=torch.float64))
    got = label_synthetic(
        [teacher, teacher], images(2), torch.tensor([0, 0]), [[5, 5, 5]] * 2, config=LabelConfig(), tau=1.0
    )
    torch.testing.assert_close(got.targets.sum(1), torch.ones(2))  # normalised rows: ulps of 1
    assert got.keep.all()  # both teachers still call it class 0, each with the same tiny weight
