"""On-device fine-tuning without Python: the classifier as an ExecuTorch training program.

The program's one method, ``forward(x, y) -> (loss, logits, gradients..., parameters...)``, is the joint
forward and backward graph of cross-entropy on a batch (``torch.export`` + ExecuTorch's
``_export_forward_backward``); the phone's ExecuTorch runtime runs it with its training extension
(``TrainingModule``) and steps the weights in place with the runtime's SGD (``SGD``), so an app fine-tunes
the global model on its own images with no Python and no torch. The finetune personalization of
``edge_sdk.personalize`` (SGD with momentum, cross-entropy on local images) is what it runs, with one
difference a phone needs: BatchNorm keeps the statistics the model came with and dropout is off (the
module in eval mode). A phone's batches are a few of its own images, whose statistics would replace the
federation's; and the trained weights are then the whole state, so the app's inference and any export
of them need nothing the program does not return.

The deployment metadata rides along as constant methods, with the recommended SGD settings
(``training``: JSON) an app passes to the runtime's optimizer.

Two graph rewrites make the program compute what torch computes in ExecuTorch's portable kernels:
``max_pool2d_with_indices_backward`` as a scatter-add of the output gradient onto its argmax positions
(the portable kernel's output is not what torch computes: its gradients came back wrong), and channels-last
layout hints dropped (the portable BatchNorm kernel takes contiguous tensors only; layout does not change a
value).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._decomp import core_aten_decompositions
from torch.export.experimental import _copy_graph_module_and_signature, _remove_detach_pass
from torch.export.exported_program import _decompose_exported_program

from common.errors import ExportError
from edge_sdk.mobile_targets import check_kernels, conversion_error
from export.metadata import DEPLOY_KEYS

__all__ = [
    "TRAINING_KEY",
    "TrainingSettings",
    "load_trainer",
    "run_training_logits",
    "torch_steps",
    "trainer_steps",
    "training_program",
    "training_settings",
]

TRAINING_KEY = "training"  # the constant method holding the recommended optimizer settings (JSON)
_PREFIX = "model."  # the wrapped classifier's parameter names in the program: "model." + its own
TrainingSettings = dict[str, float | int | str]


def training_settings(*, lr: float, momentum: float, batch_size: int) -> TrainingSettings:
    """What an app passes to the runtime's SGD, and what the program computes, as the app reads them."""
    return {
        "loss": "cross_entropy",
        "optimizer": "sgd",
        "lr": lr,
        "momentum": momentum,
        "batch_size": batch_size,
        "batchnorm": "frozen",
        "parameter_prefix": _PREFIX,
    }


class _TrainingStep(nn.Module):
    """(images, labels) -> (loss, logits): the loss first, the output the joint graph differentiates."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.model(x)
        return F.cross_entropy(logits, y), logits.detach()


def _max_pool2d_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """Each output gradient added onto the input position its max came from (indices are flat per plane,
    overlapping windows add up), as torch's kernel computes it."""
    flat = torch.zeros_like(self).flatten(-2)
    return flat.scatter_add(-1, indices.flatten(-2), grad_output.flatten(-2)).view_as(self)


def _joint(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``torch.export.experimental._export_forward_backward`` with the max-pool backward rewritten."""
    table = core_aten_decompositions()
    table[torch.ops.aten.max_pool2d_with_indices_backward.default] = _max_pool2d_backward
    program = _decompose_exported_program(
        program,
        cia_to_decomp={},
        python_decomp_table=table,
        joint_loss_index=0,
        decompose_custom_triton_ops=False,
    )
    module, signature = _copy_graph_module_and_signature(program)
    _remove_detach_pass(module, signature)
    return program._update(module, signature)


def _drop_channels_last(program: torch.export.ExportedProgram) -> None:
    """Layout hints (``x.contiguous(memory_format=torch.channels_last)``) removed in place."""
    changed = False
    for node in program.graph.nodes:
        if node.kwargs.get("memory_format") == torch.channels_last:
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "memory_format"}
            changed = True
    if changed:  # only then: recompiling an unchanged graph gave a program that crashed the runtime
        program.graph_module.recompile()


def _standard_layout(module: nn.Module) -> nn.Module:
    """A copy whose weights have standard (contiguous NCHW) strides: the program keeps each weight's
    layout, and the portable kernels refuse a channels-last weight (the layout training leaves)."""
    module = copy.deepcopy(module).eval()
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.data = tensor.data.clone(memory_format=torch.contiguous_format)
    return module


def training_program(
    module: nn.Module,
    shape: tuple[int, int, int],
    props: Mapping[str, str],
    *,
    num_classes: int,
    settings: TrainingSettings,
) -> bytes:
    """The ``.pte`` training program of ``module`` for batches of ``settings["batch_size"]`` images
    (a static shape: an app fills each batch from its own images)."""
    from executorch.exir import EdgeCompileConfig, to_edge

    batch = int(settings["batch_size"])
    generator = torch.Generator().manual_seed(0)
    example = (
        torch.rand((batch, *shape), generator=generator),
        torch.randint(num_classes, (batch,), generator=generator),
    )
    module = _standard_layout(module)
    constants = {key: props[key] for key in DEPLOY_KEYS} | {
        TRAINING_KEY: json.dumps(settings, sort_keys=True)
    }
    try:
        program = torch.export.export(_TrainingStep(module.eval()), example, strict=False)
        _drop_channels_last(program)
        edge = to_edge(
            _joint(program),
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
            constant_methods=constants,
        )
        manager = edge.to_executorch()
    except Exception as err:  # torch.export and exir raise many types, each a graph they cannot represent
        raise conversion_error("ExecuTorch training", err) from err
    return check_kernels("ExecuTorch training", manager)


def load_trainer(program: bytes):  # -> executorch.extension.training.TrainingModule
    """The program in ExecuTorch's runtime with its training extension, as the phone loads it."""
    from executorch.extension.training import _load_for_executorch_for_training_from_buffer

    return _load_for_executorch_for_training_from_buffer(program)


def _batch(x: np.ndarray, y: np.ndarray) -> tuple[Tensor, Tensor]:
    # copies with standard strides: the runtime reads a tensor's dimension order from its strides, and a
    # one-channel batch sliced from NCHW storage has strides that also read as channels-last
    return torch.from_numpy(np.array(x, np.float32)), torch.from_numpy(np.array(y, np.int64))


def run_training_logits(program: bytes, images: np.ndarray) -> np.ndarray:
    """The program's logits (its forward, labels 0: the gradients are computed and discarded, no step),
    batch by batch; a last partial batch is padded with zeros and its padding dropped."""
    trainer = load_trainer(program)
    batch = int(json.loads(trainer.model.run_method(TRAINING_KEY, ())[0])["batch_size"])
    out = []
    for start in range(0, len(images), batch):
        chunk = images[start : start + batch]
        x = np.zeros((batch, *images.shape[1:]), np.float32)
        x[: len(chunk)] = chunk
        logits = trainer.forward_backward("forward", _batch(x, np.zeros(batch, np.int64)))[1]
        out.append(logits.numpy()[: len(chunk)])
    return np.concatenate(out)


def trainer_steps(
    program: bytes, batches: Sequence[tuple[np.ndarray, np.ndarray]], *, lr: float, momentum: float
) -> tuple[list[float], dict[str, Tensor]]:
    """One SGD step per batch in ExecuTorch's runtime (forward, backward and the runtime's optimizer, as
    the phone runs them): the loss of each step before its update, and the trained parameters by the
    classifier's own names."""
    from executorch.extension.training import get_sgd_optimizer

    trainer, optimizer, losses = load_trainer(program), None, []
    for x, y in batches:
        loss = trainer.forward_backward("forward", _batch(x, y))[0]
        if optimizer is None:  # the parameters are known after the first run of the method
            optimizer = get_sgd_optimizer(trainer.named_parameters(), lr, momentum, 0, 0, False)
        optimizer.step(trainer.named_gradients())
        losses.append(float(loss))
    if optimizer is None:
        raise ExportError("no training batch was given; fix: pass at least one batch")
    params = {name.removeprefix(_PREFIX): p.clone() for name, p in trainer.named_parameters().items()}
    return losses, params


def torch_steps(
    module: nn.Module, batches: Sequence[tuple[np.ndarray, np.ndarray]], *, lr: float, momentum: float
) -> list[float]:
    """The same steps in torch (eval mode, as the program): the reference loss curve."""
    module.eval()
    optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses
