"""Seeds: independent streams derived from one user seed, and blocks run under a seeded global RNG.

Every package seeds this way, so a run is a function of its seed on every machine and never reseeds the
caller's global RNG.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

__all__ = ["derive_seed", "seeded"]


def derive_seed(*entropy: int) -> int:
    """A 63-bit seed from non-negative integers (numpy's SeedSequence hashing): one independent stream per
    purpose (a teacher, a chunk, a round) from one user seed, the same on every machine."""
    state = np.random.SeedSequence(list(entropy)).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


@contextmanager
def seeded(seed: int, device: str | torch.device = "cpu") -> Iterator[None]:
    """Run a block with torch's global RNG seeded, restoring the caller's RNG state afterwards.

    Weight init and Dropout draw from the global generator (they take no ``generator`` argument), so this
    is how a run becomes a function of ``seed`` without seeding anything for the caller.
    """
    device = torch.device(device)
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(cuda[0]):
                torch.cuda.manual_seed(seed)
        yield
