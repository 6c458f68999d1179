"""Verifying claimed label counts against the other claimants (server_kit.labelling.trust)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.errors import ConfigError
from server_kit.labelling.trust import verify_claims, verify_decoders
from server_kit.synthesis.inversion import SyntheticSet

L = 4


class ReadsTheClass(nn.Module):
    """A teacher that reads the class off the image (pixel value c / L), shifted by ``shift``."""

    def __init__(self, shift: int = 0) -> None:
        super().__init__()
        self.shift = shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = (x.mean(dim=(1, 2, 3)) * L).round().long()
        return 10.0 * nn.functional.one_hot((c + self.shift) % L, L).float()


def inversions(makers: list[tuple[int, int]], per: int = 5) -> SyntheticSet:
    """``per`` images for every (teacher, class) with the pixel value that teacher calls the class."""
    xs, ts, cs = [], [], []
    for k, shift_and_class in enumerate(makers):
        for c in shift_and_class[1]:
            shown = (c - shift_and_class[0]) % L  # what a teacher with this shift labels c
            xs.append(torch.full((per, 1, 2, 2), shown / L))
            ts.append(torch.full((per,), k))
            cs.append(torch.full((per,), c))
    return SyntheticSet(x=torch.cat(xs), teacher=torch.cat(ts), target_class=torch.cat(cs))


def test_a_shifted_teacher_claiming_every_class_is_rejected_and_honest_claims_stay():
    honest = [[30, 20, 0, 0], [0, 25, 25, 0], [10, 0, 0, 40], [0, 0, 30, 30]]
    liar = [5000] * L  # trained on shifted labels, claims everything
    modules = [ReadsTheClass() for _ in honest] + [ReadsTheClass(shift=1)]
    counts = [*honest, liar]
    made = [(0, [c for c in range(L) if row[c]]) for row in honest] + [(1, list(range(L)))]
    check = verify_claims(modules, counts, inversions(made))
    assert check.rejected == [(4, c) for c in range(L)]
    assert check.label_counts == [*honest, [0] * L]
    assert all(check.scores[4][c] == 0.0 for c in range(L))
    assert check.scores[0][0] == 0.5  # median of its pairs: 1 with the other honest holder, 0 with the liar


def test_a_class_with_one_claimant_is_kept_as_claimed():
    modules = [ReadsTheClass(), ReadsTheClass(shift=2)]
    counts = [[5, 0, 0, 0], [0, 7, 0, 0]]
    check = verify_claims(modules, counts, inversions([(0, [0]), (2, [1])]))
    assert check.rejected == [] and check.label_counts == counts
    assert check.scores == [[None] * L, [None] * L]


def test_validation():
    with pytest.raises(ConfigError, match="keep_ratio"):
        verify_claims([ReadsTheClass()], [[1, 1, 1, 1]], inversions([(0, [0])]), keep_ratio=0)
    with pytest.raises(ConfigError, match="rows"):
        verify_claims([ReadsTheClass()], [[1, 1, 1, 1]] * 2, inversions([(0, [0])]))


def test_a_teacher_failing_most_of_its_claimed_examples_loses_the_rest():
    # the liar reads classes 0-2 shifted but class 3 right: it passes on 3, fails 0-2 (most of its claim)
    class PartLiar(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            c = (x.mean(dim=(1, 2, 3)) * L).round().long()
            return 10.0 * nn.functional.one_hot(torch.where(c < 3, (c + 1) % 3, c), L).float()

    honest = [[30, 20, 0, 10], [0, 25, 25, 10], [10, 0, 40, 10], [20, 30, 0, 10]]
    modules = [ReadsTheClass() for _ in honest] + [PartLiar()]
    made = [(0, [c for c in range(L) if row[c]]) for row in honest]
    synthetic = inversions(made)
    liar_x = torch.cat([torch.full((5, 1, 2, 2), ((c - 1) % 3 if c < 3 else c) / L) for c in range(L)])
    synthetic = SyntheticSet(
        x=torch.cat([synthetic.x, liar_x]),
        teacher=torch.cat([synthetic.teacher, torch.full((20,), 4)]),
        target_class=torch.cat([synthetic.target_class, torch.arange(L).repeat_interleave(5)]),
    )
    check = verify_claims(modules, [*honest, [5000] * L], synthetic)
    assert check.scores[4][3] == 1.0  # class 3 alone would pass ...
    assert check.label_counts[4] == [0] * L  # ... but 15,000 of its 20,000 claimed examples failed


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
    decoders = [DrawsTheClass() for _ in teachers] + [DrawsTheClass(shift=1)]
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
