"""Parameter averaging of same-architecture classifiers: FedMHO's global-model initialisation (Eq. 4).

FedMHO starts the global model from the average of the classifier clients' weights, so it knows what
they learned before it sees a single synthetic image. That needs one shared architecture; with
heterogeneous classifiers :func:`fedavg_init` returns ``None`` and the caller initialises the student
another way (the paper's section 5.6 distils the classifier ensemble into it).

Weighting: Eq. 4 and the reference code average uniformly; we weight by each client's ``num_examples``
by default (FedAvg's rule: a client that trained on more data moves the average more) and offer
``weighting="uniform"`` to reproduce the paper. BatchNorm running statistics are averaged with the same
weights; integer buffers (``num_batches_tracked``) are not averaged but take the maximum.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from common.errors import ConfigError
from server_kit.teachers import Teacher

__all__ = ["WEIGHTINGS", "average_state_dicts", "fedavg_init"]

WEIGHTINGS = ("examples", "uniform")


def average_state_dicts(
    state_dicts: Sequence[Mapping[str, Tensor]], weights: Sequence[float] | None = None
) -> dict[str, Tensor]:
    """Weighted mean of floating-point tensors (weights normalised to sum to 1; ``None`` = uniform).

    Every state dict must have the same keys, shapes and dtypes. Floating tensors are averaged in
    float64 and cast back; integer / bool tensors take the element-wise maximum.
    """
    if not state_dicts:
        raise ConfigError("average_state_dicts needs at least one state dict")
    n = len(state_dicts)
    if weights is None:
        weights = [1.0] * n
    w = torch.as_tensor([float(v) for v in weights], dtype=torch.float64)
    if len(w) != n:
        raise ConfigError(f"got {len(w)} weights for {n} state dicts")
    if not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ConfigError(f"weights must be finite, >= 0 and not all zero, got {w.tolist()}")
    w = w / w.sum()
    reference = state_dicts[0]
    for i, state in enumerate(state_dicts[1:], start=1):
        if list(state) != list(reference):
            missing, extra = sorted(set(reference) - set(state)), sorted(set(state) - set(reference))
            raise ConfigError(
                f"state dict {i} has other keys than state dict 0: missing {missing}, extra {extra}"
            )
        for key, value in state.items():
            ref = reference[key]
            if value.shape != ref.shape or value.dtype != ref.dtype:
                raise ConfigError(
                    f"state dict {i}: {key!r} is {value.dtype} {tuple(value.shape)}, "
                    f"state dict 0 has {ref.dtype} {tuple(ref.shape)}"
                )
    out: dict[str, Tensor] = {}
    for key, ref in reference.items():
        values = [state[key].detach() for state in state_dicts]
        if ref.is_floating_point() or ref.is_complex():
            acc = sum(
                wi * v.to(device=ref.device, dtype=torch.float64)
                for wi, v in zip(w.tolist(), values, strict=True)
            )
            out[key] = acc.to(ref.dtype)  # type: ignore[union-attr]
        else:
            out[key] = torch.stack([v.to(ref.device) for v in values]).amax(dim=0)
    return out


def _signature(module: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(k, tuple(v.shape), v.dtype) for k, v in module.state_dict().items()]


def fedavg_init(teachers: Sequence[Teacher], *, weighting: str = "examples") -> nn.Module | None:
    """A new module: the average of the classifier teachers' weights, or ``None`` when there is nothing to
    average (no teachers, differing arch strings / state-dict layouts, or teachers with an "unknown"
    output, whose average would not be a model of the task's classes).

    ``weighting`` is ``"examples"`` (by each bundle's ``num_examples``) or ``"uniform"`` (Eq. 4). The
    result is a deep copy of the first teacher's module with the averaged state loaded, trainable
    (``requires_grad`` on) and in eval mode; the teachers are not modified.
    """
    if weighting not in WEIGHTINGS:
        raise ConfigError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    classifiers = list(teachers)
    if not classifiers:
        return None
    for t in classifiers:
        if t.bundle.kind != "classifier":
            raise ConfigError(f"fedavg_init averages classifiers, got a {t.bundle.kind!r} bundle ({t.name})")
    if any(t.bundle.unknown_output for t in classifiers):
        return None
    first = classifiers[0]
    signature = _signature(first.module)
    if any(t.bundle.arch != first.bundle.arch or _signature(t.module) != signature for t in classifiers[1:]):
        return None
    weights = [t.bundle.num_examples for t in classifiers] if weighting == "examples" else None
    state = average_state_dicts([t.module.state_dict() for t in classifiers], weights)
    module = copy.deepcopy(first.module)
    module.load_state_dict(state, strict=True)
    return module.eval().requires_grad_(True)
