"""Checking each decoder's claimed classes against the teachers that hold them
(server_kit.labelling.decoder_trust)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.errors import ConfigError
from edge_sdk.data import ArrayDataset, load_dataset
from edge_sdk.models.arch import build_model
from edge_sdk.train import TrainConfig, train
from server_kit.labelling.decoder_trust import verify_decoders

L = 4


class ReadsTheClass(nn.Module):
    """A teacher that reads the class off the image (pixel value c / L), shifted by ``shift``."""

    def __init__(self, shift: int = 0) -> None:
        super().__init__()
        self.shift = shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = (x.mean(dim=(1, 2, 3)) * L).round().long()
        return 10.0 * nn.functional.one_hot((c + self.shift) % L, L).float()


class DrawsTheClass(nn.Module):
    """A decoder that draws class c as the pixel value (c + shift) / L (plus noise from z)."""

    latent_dim = 2

    def __init__(self, shift: int = 0) -> None:
        super().__init__()
        self.shift = shift

    def forward(self, z: torch.Tensor, y_onehot: torch.Tensor) -> torch.Tensor:
        c = (y_onehot.argmax(1) + self.shift) % L
        return (c.float() / L).view(-1, 1, 1, 1).expand(-1, 1, 2, 2) + 0.01 * z[:, :1, None, None].tanh()


def test_a_decoder_trained_on_shifted_labels_loses_its_claims_and_honest_decoders_keep_theirs():
    teachers = [[30, 20, 0, 0], [0, 25, 25, 0], [10, 0, 0, 40], [0, 0, 30, 30]]
    modules = [ReadsTheClass() for _ in teachers]
    decoder_counts = [*teachers, [5000] * L]  # four honest decoders and a liar claiming every class
    decoders = [DrawsTheClass() for _ in teachers] + [DrawsTheClass(shift=-1)]
    check = verify_decoders(modules, teachers, decoders, decoder_counts, probe=8)
    assert check.rejected == [(4, c) for c in range(L)]
    assert check.label_counts == [*teachers, [0] * L]
    assert check.scores[4] == [0.0] * L and check.scores[0][:2] == [1.0, 1.0]
    # the same decoder with honest labels passes: only what it draws decides
    fair = verify_decoders(modules, teachers, [*decoders[:4], DrawsTheClass()], decoder_counts, probe=8)
    assert fair.rejected == [] and fair.label_counts == decoder_counts
    with pytest.raises(ConfigError, match="probe"):
        verify_decoders(modules, teachers, decoders, decoder_counts, probe=0)
    with pytest.raises(ConfigError, match="rows"):
        verify_decoders(modules, teachers, decoders[:2], decoder_counts)


def test_the_liars_own_classifier_claiming_every_class_does_not_vouch_for_its_decoder():
    """A device uploads a classifier and a decoder trained on the same shifted labels, the classifier
    claiming 5,000 of every class: weighted by claimed counts it would own the vote on every class and
    call its decoder's samples right. The median over the holders of a class is not moved by it."""
    honest = [[30, 20, 0, 0], [0, 25, 25, 0], [10, 0, 0, 40], [0, 0, 30, 30], [20, 20, 20, 20]]
    modules = [ReadsTheClass() for _ in honest] + [ReadsTheClass(shift=1)]
    counts = [*honest, [5000] * L]
    decoders = [DrawsTheClass() for _ in honest] + [DrawsTheClass(shift=-1)]
    check = verify_decoders(modules, counts, decoders, counts, probe=8)
    assert check.rejected == [(5, c) for c in range(L)]
    assert check.label_counts[:5] == honest


class Lookup(nn.Module):
    """A stand-in decoder on real digits: asked for class y it returns a digit of class y + shift (the
    z picks which), optionally blurred (half of it a 3 x 3 box average, as a small CVAE's samples are)."""

    latent_dim = 3

    def __init__(self, data: ArrayDataset, shift: int = 0, blur: bool = False) -> None:
        super().__init__()
        self.x, self.y, self.shift, self.blur = data.x.float() / 255, data.y, shift, blur

    def forward(self, z: torch.Tensor, y_onehot: torch.Tensor) -> torch.Tensor:
        wanted = (y_onehot.argmax(1) + self.shift) % y_onehot.shape[1]
        pick = (z[:, 0].abs() * 997).long()
        out = []
        for c, p in zip(wanted.tolist(), pick.tolist(), strict=True):
            pool = (self.y == c).nonzero().flatten()
            out.append(self.x[pool[p % len(pool)]])
        x = torch.stack(out)
        if self.blur:
            x = 0.5 * x + 0.5 * nn.functional.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)
        return x


@pytest.fixture(scope="module")
def digits() -> tuple[ArrayDataset, ArrayDataset]:
    return load_dataset("digits", "train"), load_dataset("digits", "test")


def test_on_digits_decoders_drawing_y_minus_1_are_refused_and_no_honest_claim_is(digits):
    """Three honest digits classifiers, one trained on shifted labels (claiming every class 5,000 times);
    six honest decoders (two blurry, some holding few classes) and three colluding ones, identical,
    drawing y - 1 when asked for y with honest-looking counts."""
    train_set, test_set = digits
    teachers = []
    for k, spec in enumerate(("C8k3-P-F10", "C6k3-P-F16-F10", "C8k3-C8k3-P-F10", "C8k3-P-F10")):
        shifted = ArrayDataset(train_set.x, (train_set.y + 1) % 10, 10) if k == 3 else train_set
        with torch.random.fork_rng():
            torch.manual_seed(k)
            model = build_model(spec, (1, 8, 8), 10)
        train(model, shifted, config=TrainConfig(epochs=3, lr=3e-3, batch_size=64), seed=k)
        teachers.append(model.eval())
    teacher_counts = [[50] * 10, [50] * 10, [50] * 10, [5000] * 10]
    every = [40] * 10
    few = [[90, 0, 0, 60, 0, 0, 70, 0, 0, 30], [0, 80, 0, 0, 50, 0, 0, 40, 0, 0]]
    decoder_counts = [every, every, every, *few, every, every, every, every]
    decoders = [
        Lookup(test_set),
        Lookup(test_set, blur=True),
        Lookup(test_set),
        Lookup(test_set),
        Lookup(test_set, blur=True),
        Lookup(test_set),
        *[Lookup(test_set, shift=-1)] * 3,
    ]
    check = verify_decoders(teachers, teacher_counts, decoders, decoder_counts, probe=16, seed=1)
    liars = {6, 7, 8}
    assert {d for d, _ in check.rejected} == liars, (check.rejected, check.scores)
    assert all(check.label_counts[d] == [0] * 10 for d in liars)
    assert check.label_counts[:6] == decoder_counts[:6]


class BadAt(DrawsTheClass):
    """An honest decoder that draws class ``bad`` as another class (it saw a handful of its examples)."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad = bad

    def forward(self, z: torch.Tensor, y_onehot: torch.Tensor) -> torch.Tensor:
        x = super().forward(z, y_onehot)
        return torch.where((y_onehot.argmax(1) == self.bad).view(-1, 1, 1, 1), torch.full_like(x, 0.5), x)


def test_a_small_claim_drawn_badly_is_kept_and_a_heavy_one_is_refused():
    """Per class, only a claim weighing at least the median claim of its class is refused: a decoder that
    saw 2 examples of class 0 buys little of it; one claiming 90 and drawing another class is refused."""
    teachers = [[30, 20, 20, 20]] * 4
    modules = [ReadsTheClass() for _ in teachers]
    counts = [[30, 20, 20, 20], [30, 20, 20, 20], [30, 20, 20, 20], [2, 40, 40, 40], [90, 40, 40, 40]]
    decoders = [DrawsTheClass(), DrawsTheClass(), DrawsTheClass(), BadAt(0), BadAt(0)]
    check = verify_decoders(modules, teachers, decoders, counts, probe=8)
    assert check.scores[3][0] == 0.0 and check.scores[4][0] == 0.0
    assert check.rejected == [(4, 0)]
    assert check.label_counts[3] == counts[3] and check.label_counts[4] == [0, 40, 40, 40]
