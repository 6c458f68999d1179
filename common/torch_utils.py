"""Small torch helpers shared by every package: the batch of forward-only passes, a frozen teacher."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

__all__ = ["INFER_BATCH", "batched_logits", "frozen"]

# Images per forward-only pass over many samples (validation, the vote, the claim checks, evaluation, in torch
# and in onnxruntime). On a CPU a small CNN's activations at a batch of hundreds leave the caches, and the
# same pass runs slower per image (benchmarks/RESULTS.md, "The forward passes' batch and the optimizers'
# update"); a model in eval mode gives each image the same output at any batch, so the batch is a speed
# setting only. Smaller batches also keep a wide layer's activations, which set a process's peak memory,
# small.
INFER_BATCH = 64


@contextlib.contextmanager
def frozen(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` in eval mode with ``requires_grad`` False for the block, the caller's flags restored after.

    A teacher that a generator or an inversion optimises against must not update its BatchNorm statistics
    nor collect gradients, but the caller may go on training it afterwards.
    """
    was_training = module.training
    flags = [p.requires_grad for p in module.parameters()]
    module.eval().requires_grad_(False)
    try:
        yield module
    finally:
        for p, flag in zip(module.parameters(), flags, strict=True):
            p.requires_grad_(flag)
        module.train(was_training)


@torch.no_grad()
def batched_logits(
    module: nn.Module,
    x: Tensor,
    *,
    device: str | torch.device = "cpu",
    batch_size: int = INFER_BATCH,
) -> Tensor:
    """``module``'s N x L float32 logits on ``x``, on the CPU: eval mode on ``device`` (where the module is
    moved), ``batch_size`` images at a time, the module's training flag restored. Float32 throughout:
    the callers (the fusion, the supernet's and PKE's targets) distil from these logits as they are."""
    was_training = module.training
    dev = torch.device(device)
    module.eval().to(dev)
    try:
        starts = range(0, len(x), batch_size)
        return torch.cat([module(x[i : i + batch_size].to(dev)).float().cpu() for i in starts])
    finally:
        module.train(was_training)
