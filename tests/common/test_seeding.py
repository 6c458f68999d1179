"""Seeds: derived streams are stable and distinct, a seeded block leaves the caller's RNG alone."""

from __future__ import annotations

import torch

from common.seeding import derive_seed, seeded


def test_derived_seeds_are_stable_63_bit_and_distinct_per_stream() -> None:
    seeds = {derive_seed(0, stream) for stream in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(7, 2) == derive_seed(7, 2) != derive_seed(2, 7)


def test_seeded_block_is_a_function_of_the_seed_and_restores_the_caller_rng() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    with seeded(5):
        first = torch.rand(3)
    with seeded(5):
        assert torch.equal(torch.rand(3), first)
    assert torch.equal(torch.rand(3), expected_next)
