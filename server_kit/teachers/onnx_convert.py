"""A small generic ONNX -> torch converter for classifier teachers that did not come from our edge SDK.

Bundles written by the edge SDK are rebuilt from their architecture string (exact and fast, see
:mod:`server_kit.teachers.loading`); this module is the fallback for "foreign" ONNX files. We interpret the
graph
ourselves rather than depend on onnx2torch (unmaintained; rejects ReduceMean-18, AveragePool-19, ...) or
onnx2pytorch (its BatchNorm wrapper hides the inner module from forward hooks):

* a node becomes a real module where the server needs one: BatchNormalization with constant statistics
  -> ``nn.BatchNorm{1,2,3}d`` in eval mode (DeepInversion hooks read its input and running stats), Conv
  with a constant weight -> ``nn.Conv{1,2,3}d``, Gemm / MatMul with a constant 2-D weight -> ``nn.Linear``
  (so the classifier head is found like any torch model's). Every other node is one torch call, so the
  module is differentiable w.r.t. its input;
* nodes whose inputs are all constants are folded once at conversion; Identity / Dropout become aliases;
  constant shape-like inputs (Reshape shape, axes, Clip bounds) become attributes, so a GPU forward does
  not synchronise to read them;
* every unsupported operator is reported at once, before anything is built.

The bytes may come from anywhere: they are parsed by :func:`export.onnx_check.parse_onnx` and must pass
:func:`export.onnx_check.check_onnx` (shapes as the graph declares them) before any tensor is read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import nn

from common.checks import check_int, is_number
from common.errors import TeacherError
from export.onnx_check import check_onnx, parse_onnx

__all__ = ["SUPPORTED_OPS", "OnnxModule", "convert_onnx"]

Tensor = torch.Tensor
Args = list[Any]  # input tensors in node order; None where an optional input is left out


# ---- runtime ops: fn(args, attrs) -> Tensor | tuple[Tensor, ...]; attrs are canonical (see _prepare) ----


def _spatial_pads(x: Tensor, at: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(begin, end) pads per spatial axis, resolving auto_pad from the runtime input size."""
    kernel, strides, dilations = at["kernel"], at["strides"], at["dilations"]
    n = len(kernel)
    if at["auto_pad"] in ("NOTSET", "VALID"):
        pads = at["pads"] if at["auto_pad"] == "NOTSET" else [0] * (2 * n)
        return list(pads[:n]), list(pads[n:])
    begin, end = [], []
    for size, k, s, d in zip(x.shape[2:], kernel, strides, dilations, strict=True):
        total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
        small, large = total // 2, total - total // 2
        begin.append(small if at["auto_pad"] == "SAME_UPPER" else large)
        end.append(large if at["auto_pad"] == "SAME_UPPER" else small)
    return begin, end


def _torch_pad(begin: list[int], end: list[int]) -> list[int]:
    return [p for b, e in zip(reversed(begin), reversed(end), strict=True) for p in (b, e)]  # last axis first


def _pool(args: Args, at: dict[str, Any]) -> Tensor:
    x = args[0]
    n, kernel, strides = len(at["kernel"]), at["kernel"], at["strides"]
    begin, end = _spatial_pads(x, at)
    # torch pools take only symmetric pads of at most half the kernel; anything else is padded explicitly
    native = begin == end and all(2 * p <= k for p, k in zip(begin, kernel, strict=True))
    padding = begin if native else [0] * n
    if at["kind"] == "max":
        pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[n - 1]
        if not native:
            x = F.pad(x, _torch_pad(begin, end), value=float("-inf"))
        return pool(x, kernel, strides, padding, at["dilations"], ceil_mode=at["ceil_mode"])
    avg = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[n - 1]
    if native:
        return avg(x, kernel, strides, padding, at["ceil_mode"], at["count_include_pad"])
    pad = _torch_pad(begin, end)
    total = avg(F.pad(x, pad), kernel, strides, 0, at["ceil_mode"], True)
    if at["count_include_pad"]:
        return total
    ones = F.pad(torch.ones((1, 1, *x.shape[2:]), dtype=x.dtype, device=x.device), pad)
    return total / avg(ones, kernel, strides, 0, at["ceil_mode"], True)  # sum over real pixels / their count


def _conv(args: Args, at: dict[str, Any]) -> Tensor:
    x, w, b = args[0], args[1], args[2] if len(args) > 2 else None
    n = w.dim() - 2
    begin, end = _spatial_pads(x, {**at, "kernel": list(w.shape[2:])})
    if begin != end:
        x = F.pad(x, _torch_pad(begin, end))
        begin = [0] * n
    conv = (F.conv1d, F.conv2d, F.conv3d)[n - 1]
    return conv(x, w, b, at["strides"], begin, at["dilations"], at["group"])


def _ints(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    return [int(v) for v in value]


def _reduce(args: Args, at: dict[str, Any]) -> Tensor:
    x = args[0]
    axes = at["axes"] if at["axes"] is not None else _ints(args[1] if len(args) > 1 else None)
    if not axes:
        if at["noop"]:
            return x
        axes = list(range(x.dim()))
    keep = bool(at["keepdims"])
    if at["kind"] == "mean":
        return x.mean(dim=axes, keepdim=keep)
    if at["kind"] == "sum":
        return x.sum(dim=axes, keepdim=keep)
    return x.amax(dim=axes, keepdim=keep)


def _reshape(args: Args, at: dict[str, Any]) -> Tensor:
    x = args[0]
    shape = at["shape"] if at["shape"] is not None else _ints(args[1])
    if not at["allowzero"]:
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return x.reshape(shape)


def _flatten(args: Args, at: dict[str, Any]) -> Tensor:
    x = args[0]
    axis = at["axis"] % x.dim() if x.dim() else 0
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


def _squeeze(args: Args, at: dict[str, Any]) -> Tensor:
    x = args[0]
    axes = at["axes"] if at["axes"] is not None else _ints(args[1] if len(args) > 1 else None)
    if axes is None:
        return x.squeeze()
    return x.squeeze(tuple(a % x.dim() for a in axes))


def _unsqueeze(args: Args, at: dict[str, Any]) -> Tensor:
    x = args[0]
    axes = at["axes"] if at["axes"] is not None else _ints(args[1])
    rank = x.dim() + len(axes)
    for axis in sorted(a % rank for a in axes):
        x = x.unsqueeze(axis)
    return x


def _gemm(args: Args, at: dict[str, Any]) -> Tensor:
    a, b, c = args[0], args[1], args[2] if len(args) > 2 else None
    a = a.t() if at["transA"] else a
    b = b.t() if at["transB"] else b
    y = at["alpha"] * (a @ b)
    return y if c is None else y + at["beta"] * c


def _div(args: Args, at: dict[str, Any]) -> Tensor:
    a, b = args[0], args[1]
    if a.dtype.is_floating_point or b.dtype.is_floating_point:
        return a / b
    return torch.div(a, b, rounding_mode="trunc")  # ONNX integer division truncates, as C does


def _clip(args: Args, at: dict[str, Any]) -> Tensor:
    x = args[0]
    lo = at["min"] if at["min"] is not None else (args[1] if len(args) > 1 else None)
    hi = at["max"] if at["max"] is not None else (args[2] if len(args) > 2 else None)
    return x if lo is None and hi is None else torch.clamp(x, lo, hi)


def _softmax(args: Args, at: dict[str, Any]) -> Tensor:
    x = args[0]
    fn = F.log_softmax if at["log"] else F.softmax
    if not at["legacy"]:
        return fn(x, dim=at["axis"])
    axis = at["axis"] % x.dim()  # opset < 13: softmax over the input coerced to 2-D at `axis`
    return fn(x.reshape(math.prod(x.shape[:axis]), -1), dim=1).reshape(x.shape)


def _gather(args: Args, at: dict[str, Any]) -> Tensor:
    x, idx = args[0], args[1]
    axis = at["axis"] % x.dim()
    idx = idx.to(device=x.device, dtype=torch.long)
    idx = torch.where(idx < 0, idx + x.shape[axis], idx)
    out = x.index_select(axis, idx.reshape(-1))
    return out.reshape((*x.shape[:axis], *idx.shape, *x.shape[axis + 1 :]))


def _batchnorm(args: Args, at: dict[str, Any]) -> Tensor:
    x, scale, bias, mean, var = args[:5]
    return F.batch_norm(x, mean, var, scale, bias, training=False, eps=at["epsilon"])


def _shape(args: Args, at: dict[str, Any]) -> Tensor:
    x = args[0]
    return torch.tensor(x.shape[at["start"] : at["end"]], dtype=torch.long, device=x.device)


def _dropout(args: Args, at: dict[str, Any]) -> tuple[Tensor, Tensor]:
    x = args[0]
    return x, torch.ones_like(x, dtype=torch.bool)  # eval: identity, mask all kept


def _one(fn: Callable[..., Tensor]) -> Callable[[Args, dict[str, Any]], Tensor]:
    return lambda args, at: fn(*args)


def _global_pool(args: Args, at: dict[str, Any]) -> Tensor:
    dims = tuple(range(2, args[0].dim()))
    return args[0].amax(dim=dims, keepdim=True) if at["max"] else args[0].mean(dim=dims, keepdim=True)


def _transpose(args: Args, at: dict[str, Any]) -> Tensor:
    return args[0].permute(at["perm"] or list(range(args[0].dim()))[::-1])


_OPS: dict[str, Callable[[Args, dict[str, Any]], Tensor | tuple[Tensor, ...]]] = {
    "Add": _one(torch.add),
    "AveragePool": _pool,
    "BatchNormalization": _batchnorm,
    "Cast": lambda args, at: args[0].to(at["dtype"]),
    "Clip": _clip,
    "Concat": lambda args, at: torch.cat([a for a in args if a is not None], dim=at["axis"]),
    "Constant": lambda args, at: at["value"],
    "Conv": _conv,
    "Div": _div,
    "Dropout": _dropout,
    "Flatten": _flatten,
    "Gather": _gather,
    "Gemm": _gemm,
    "GlobalAveragePool": _global_pool,
    "GlobalMaxPool": _global_pool,
    "HardSigmoid": lambda args, at: torch.clamp(at["alpha"] * args[0] + at["beta"], 0.0, 1.0),
    "HardSwish": _one(F.hardswish),
    "Identity": lambda args, at: args[0],
    "LeakyRelu": lambda args, at: F.leaky_relu(args[0], at["alpha"]),
    "LogSoftmax": _softmax,
    "MatMul": _one(torch.matmul),
    "MaxPool": _pool,
    "Mul": _one(torch.mul),
    "ReduceMax": _reduce,
    "ReduceMean": _reduce,
    "ReduceSum": _reduce,
    "Relu": _one(F.relu),
    "Reshape": _reshape,
    "Shape": _shape,
    "Sigmoid": _one(torch.sigmoid),
    "Softmax": _softmax,
    "Squeeze": _squeeze,
    "Sub": _one(torch.sub),
    "Tanh": _one(torch.tanh),
    "Transpose": _transpose,
    "Unsqueeze": _unsqueeze,
}
SUPPORTED_OPS: tuple[str, ...] = tuple(sorted(_OPS))


# ---- the converted module ----


@dataclass(frozen=True)
class _Step:
    """One node at run time: a submodule (``module`` = its key) or a function of ``_OPS`` (``op``)."""

    op: str
    inputs: tuple[str, ...]  # "" = optional input left out
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    module: str | None = None
    release: tuple[str, ...] = ()  # values no later step reads; dropped to bound forward memory


class _PaddedConv(nn.Module):
    """A conv with ONNX pads torch cannot express (asymmetric or auto_pad SAME): pad explicitly, then conv."""

    def __init__(self, conv: nn.Module, attrs: dict[str, Any]) -> None:
        super().__init__()
        self.conv = conv
        self.attrs = attrs

    def forward(self, x: Tensor) -> Tensor:
        begin, end = _spatial_pads(x, self.attrs)
        return self.conv(F.pad(x, _torch_pad(begin, end)))


class OnnxModule(nn.Module):
    """An ONNX graph executed with torch ops. ``nodes`` holds the real modules (BN, conv, linear) by node
    name; ``constants`` holds the remaining initializers (parameters) and folded constants (buffers)."""

    def __init__(
        self,
        input_name: str,
        output_name: str,
        steps: list[_Step],
        nodes: dict[str, nn.Module],
        constants: dict[str, tuple[Tensor, bool]],
        opset: int,
    ) -> None:
        super().__init__()
        self.input_name, self.output_name, self.opset = input_name, output_name, opset
        self.nodes = nn.ModuleDict(nodes)
        self.constants = nn.Module()
        self._constant_keys: list[tuple[str, str]] = []  # (ONNX name, attribute name)
        taken: set[str] = set()
        for name, (value, is_parameter) in constants.items():
            key = _attribute_name(name, taken)
            if is_parameter:
                self.constants.register_parameter(key, nn.Parameter(value))
            else:
                self.constants.register_buffer(key, value)
            self._constant_keys.append((name, key))
        self._steps = steps

    @property
    def head(self) -> nn.Linear:
        """The last ``nn.Linear`` in execution order (the classifier of a converted classifier)."""
        linears = [m for m in self.nodes.values() if isinstance(m, nn.Linear)]
        if not linears:
            raise TeacherError("the converted ONNX graph has no Gemm/MatMul with a constant 2-D weight")
        return linears[-1]

    def forward(self, x: Tensor) -> Tensor:
        env: dict[str, Tensor | None] = {
            name: getattr(self.constants, key) for name, key in self._constant_keys
        }
        env[self.input_name] = x
        for step in self._steps:
            args = [env[name] if name else None for name in step.inputs]
            if step.module is not None:
                out: Tensor | tuple[Tensor, ...] = self.nodes[step.module](*args)
            else:
                out = _OPS[step.op](args, step.attrs)
            if isinstance(out, Tensor):
                env[step.outputs[0]] = out
            else:
                env.update((name, value) for name, value in zip(step.outputs, out, strict=False) if name)
            for name in step.release:
                del env[name]
        result = env[self.output_name]
        assert result is not None
        return result


def _attribute_name(name: str, taken: set[str]) -> str:
    key = re.sub(r"\W", "_", name) or "_"
    key = f"_{key}" if key[0].isdigit() else key
    base, i = key, 1
    while key in taken:
        key, i = f"{base}_{i}", i + 1
    taken.add(key)
    return key


# ---- conversion ----


class _Builder:
    """Walks the graph once, in order (ONNX nodes are topologically sorted), building steps and modules."""

    def __init__(self, opset: int, initializers: dict[str, Tensor], ranks: dict[str, int]) -> None:
        self.opset, self.ranks = opset, ranks
        self.consts: dict[str, Tensor] = dict(initializers)
        self.parameters = {n for n, t in initializers.items() if t.dtype.is_floating_point}
        self.alias: dict[str, str] = {}
        self.steps: list[_Step] = []
        self.modules: dict[str, nn.Module] = {}
        self.taken: set[str] = set()

    def resolve(self, name: str) -> str:
        while name in self.alias:
            name = self.alias[name]
        return name

    def const_ints(self, name: str) -> list[int] | None:
        return _ints(self.consts[name]) if name in self.consts else None

    def add(self, node: onnx.NodeProto, index: int) -> None:
        label = node.name or f"{node.op_type}_{index}"
        inputs = [self.resolve(n) if n else "" for n in node.input]
        outputs = list(node.output)
        attrs = {a.name: _attr_value(a) for a in node.attribute}
        op = node.op_type
        if op == "Identity" or (op == "Dropout" and (len(outputs) < 2 or not outputs[1])):
            self.alias[outputs[0]] = inputs[0]
            return
        if op == "MaxPool" and len(outputs) > 1 and outputs[1]:
            raise TeacherError(f"node {label!r}: MaxPool with an Indices output is not supported")
        builder = _MODULE_BUILDERS.get(op)
        module = builder(self, label, inputs, attrs) if builder else None
        if module is not None:
            key = _attribute_name(label, self.taken)
            self.modules[key] = module
            self.steps.append(_Step(op, (inputs[0],), (outputs[0],), module=key))
            return
        inputs, canonical = _prepare(self, op, label, inputs, attrs)
        if all(not n or n in self.consts for n in inputs):  # constant subgraph: evaluate once, now
            with torch.no_grad():
                out = _OPS[op]([self.consts[n] if n else None for n in inputs], canonical)
            values = (out,) if isinstance(out, Tensor) else out
            self.consts.update((n, v.detach()) for n, v in zip(outputs, values, strict=False) if n)
            return
        self.steps.append(_Step(op, tuple(inputs), tuple(outputs), canonical))

    def build(self, input_name: str, output_name: str) -> OnnxModule:
        output_name = self.resolve(output_name)
        last_use: dict[str, int] = {}
        for i, step in enumerate(self.steps):
            for name in step.inputs:
                last_use[name] = i
        keep = set(self.consts) | {output_name}
        steps = [
            _Step(
                s.op,
                s.inputs,
                s.outputs,
                s.attrs,
                s.module,
                tuple(sorted({n for n in s.inputs if n and last_use[n] == i and n not in keep})),
            )
            for i, s in enumerate(self.steps)
        ]
        used = {n for s in steps for n in s.inputs if n in self.consts}
        if output_name in self.consts:
            used.add(output_name)
        constants = {n: (self.consts[n], n in self.parameters) for n in sorted(used)}
        return OnnxModule(input_name, output_name, steps, self.modules, constants, self.opset)


def _attr_value(attr: onnx.AttributeProto) -> Any:
    value = onnx.helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode()
    if attr.type == onnx.AttributeProto.FLOAT:  # float32 on the wire: 1e-5 reads back as 9.9999997e-06
        return float(str(np.float32(value)))  # the shortest decimal with the same float32 value
    return value


def _pool_attrs(op: str, label: str, attrs: dict[str, Any]) -> dict[str, Any]:
    """Window attributes shared by Conv and the pools, with ONNX defaults filled in."""
    kernel = list(attrs.get("kernel_shape", []))
    n = len(kernel) if kernel else 2  # Conv may omit kernel_shape; it is then read from the weight
    at = {
        "kernel": kernel,
        "strides": list(attrs.get("strides", [1] * n)),
        "pads": list(attrs.get("pads", [0] * (2 * n))),
        "dilations": list(attrs.get("dilations", [1] * n)),
        "auto_pad": attrs.get("auto_pad", "NOTSET") or "NOTSET",
    }
    if at["auto_pad"] not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        raise TeacherError(f"node {label!r} ({op}): unknown auto_pad {at['auto_pad']!r}")
    return at


def _prepare(
    b: _Builder, op: str, label: str, inputs: list[str], attrs: dict[str, Any]
) -> tuple[list[str], dict[str, Any]]:
    """Canonical attributes for ``op`` whatever the opset; constant shape-like inputs move into them."""

    def from_input(position: int, attr: str) -> list[int] | None:
        """An int list given as attribute (older opsets) or as input ``position`` (newer ones)."""
        if attr in attrs:
            return [int(v) for v in attrs[attr]]
        if len(inputs) > position and inputs[position] in b.consts:
            value = b.const_ints(inputs[position])
            inputs[position] = ""
            return value
        return None

    if op in ("MaxPool", "AveragePool"):
        at = _pool_attrs(op, label, attrs)
        at.update(kind="max" if op == "MaxPool" else "avg", ceil_mode=bool(attrs.get("ceil_mode", 0)))
        at["count_include_pad"] = bool(attrs.get("count_include_pad", 0))
        if op == "AveragePool" and any(d != 1 for d in at["dilations"]):
            raise TeacherError(
                f"node {label!r}: AveragePool with dilations {at['dilations']} is not supported"
            )
        return inputs, at
    if op == "Conv":
        at = _pool_attrs(op, label, attrs)
        at["group"] = _group(label, attrs)
        return inputs, at
    if op in ("ReduceMean", "ReduceSum", "ReduceMax"):
        axes = from_input(1, "axes")
        kind = {"ReduceMean": "mean", "ReduceSum": "sum", "ReduceMax": "max"}[op]
        noop = bool(attrs.get("noop_with_empty_axes", 0))
        return inputs, {"axes": axes, "keepdims": attrs.get("keepdims", 1), "noop": noop, "kind": kind}
    if op in ("Squeeze", "Unsqueeze"):
        return inputs, {"axes": from_input(1, "axes")}
    if op == "Reshape":
        return inputs, {"shape": from_input(1, "shape"), "allowzero": bool(attrs.get("allowzero", 0))}
    if op == "Clip":
        bounds: dict[str, float | None] = {"min": attrs.get("min"), "max": attrs.get("max")}
        for position, key in ((1, "min"), (2, "max")):
            if len(inputs) > position and inputs[position] in b.consts:
                bounds[key] = float(b.consts[inputs[position]].reshape(-1)[0])
                inputs[position] = ""
        return inputs, bounds
    if op in ("Softmax", "LogSoftmax"):
        legacy = b.opset < 13
        return inputs, {
            "axis": int(attrs.get("axis", 1 if legacy else -1)),
            "legacy": legacy,
            "log": op[0] == "L",
        }
    if op == "Constant":
        return inputs, {"value": _constant_value(label, attrs)}
    if op == "Cast":
        return inputs, {"dtype": _torch_dtype(label, int(attrs["to"]))}
    if op == "BatchNormalization":
        return inputs, {"epsilon": _check_bn(label, attrs)}
    if op == "Dropout":
        return inputs[:1], {}
    if op in ("GlobalAveragePool", "GlobalMaxPool"):
        return inputs, {"max": op == "GlobalMaxPool"}
    defaults: dict[str, dict[str, Any]] = {
        "LeakyRelu": {"alpha": 0.01},
        "HardSigmoid": {"alpha": 0.2, "beta": 0.5},
        "Flatten": {"axis": 1},
        "Concat": {"axis": None},
        "Gather": {"axis": 0},
        "Transpose": {"perm": None},
        "Gemm": {"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0},
        "Shape": {"start": 0, "end": None},
    }
    return inputs, {k: attrs.get(k, v) for k, v in defaults.get(op, {}).items()}


def _check_bn(label: str, attrs: dict[str, Any]) -> float:
    """The node's epsilon, once it is an inference-mode BatchNormalization with a finite epsilon > 0."""
    if int(attrs.get("training_mode", 0)):
        raise TeacherError(
            f"node {label!r}: BatchNormalization with training_mode=1 uses batch statistics; "
            "export the model in eval mode (model.eval(), training=TrainingMode.PRESERVE)"
        )
    eps = attrs.get("epsilon", 1e-5)
    if not is_number(eps) or eps <= 0:
        raise TeacherError(f"node {label!r}: BatchNormalization epsilon must be finite and > 0, got {eps!r}")
    return float(eps)


def _group(label: str, attrs: dict[str, Any]) -> int:
    return check_int(f"node {label!r}: Conv group", attrs.get("group", 1), 1, error=TeacherError)


def _constant_value(label: str, attrs: dict[str, Any]) -> Tensor:
    if "value" in attrs:
        return _tensor(label, attrs["value"])
    for key, dtype in (("value_float", torch.float32), ("value_floats", torch.float32)):
        if key in attrs:
            return torch.tensor(attrs[key], dtype=dtype)
    for key in ("value_int", "value_ints"):
        if key in attrs:
            return torch.tensor(attrs[key], dtype=torch.long)
    raise TeacherError(
        f"node {label!r}: Constant with {sorted(attrs)} is not supported (only numeric values)"
    )


def _torch_dtype(label: str, onnx_type: int) -> torch.dtype:
    try:
        np_dtype = onnx.helper.tensor_dtype_to_np_dtype(onnx_type)
        return torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype
    except (KeyError, TypeError, ValueError) as err:
        raise TeacherError(f"node {label!r}: Cast to ONNX type {onnx_type} is not supported") from err


def _tensor(name: str, proto: onnx.TensorProto) -> Tensor:
    try:
        array = numpy_helper.to_array(proto)
        return torch.from_numpy(np.array(array, copy=True))
    except (TypeError, ValueError, OSError, RuntimeError) as err:
        raise TeacherError(
            f"tensor {name!r} cannot be read ({err}); expected numeric data stored inside the ONNX file"
        ) from err


# ---- nodes that become real modules when their weights are constants (None = run functionally) ----


def _bn_module(b: _Builder, label: str, inputs: list[str], attrs: dict[str, Any]) -> nn.Module | None:
    eps = _check_bn(label, attrs)
    x, scale, bias, mean, var = [*inputs, "", "", "", ""][:5]
    if x in b.consts or not all(n in b.consts for n in (scale, bias, mean, var)):
        return None
    rank = b.ranks.get(x, 4)
    bn_class = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 5: nn.BatchNorm3d}.get(rank, nn.BatchNorm2d)
    momentum = 1.0 - float(attrs.get("momentum", 0.9))  # ONNX weights the old value, torch the new one
    bn = bn_class(b.consts[mean].numel(), eps=eps, momentum=momentum)
    pairs = ((bn.weight, scale), (bn.bias, bias), (bn.running_mean, mean), (bn.running_var, var))
    with torch.no_grad():
        for target, name in pairs:
            target.copy_(b.consts[name].reshape(-1))
    return bn.eval()


def _conv_module(b: _Builder, label: str, inputs: list[str], attrs: dict[str, Any]) -> nn.Module | None:
    x, w, bias = [*inputs, "", ""][:3]
    if x in b.consts or w not in b.consts or (bias and bias not in b.consts):
        return None
    if not 3 <= b.consts[w].dim() <= 5:
        return None
    weight = b.consts[w]
    n = weight.dim() - 2
    at = _pool_attrs("Conv", label, attrs)
    at["kernel"] = list(weight.shape[2:])
    group = _group(label, attrs)
    explicit = at["auto_pad"] in ("SAME_UPPER", "SAME_LOWER") or at["pads"][:n] != at["pads"][n:]
    padding = [0] * n if explicit or at["auto_pad"] == "VALID" else at["pads"][:n]
    conv_class = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[n - 1]
    conv = conv_class(
        weight.shape[1] * group, weight.shape[0], tuple(weight.shape[2:]), at["strides"], padding,
        at["dilations"], group, bias=bool(bias),
    )  # fmt: skip
    with torch.no_grad():
        conv.weight.copy_(weight)
        if bias:
            conv.bias.copy_(b.consts[bias])
    return _PaddedConv(conv, at) if explicit else conv


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


def _gemm_module(b: _Builder, label: str, inputs: list[str], attrs: dict[str, Any]) -> nn.Module | None:
    a, w, c = [*inputs, "", ""][:3]
    if int(attrs.get("transA", 0)) or a in b.consts or w not in b.consts or b.consts[w].dim() != 2:
        return None
    weight = b.consts[w] if int(attrs.get("transB", 0)) else b.consts[w].t()
    weight = float(attrs.get("alpha", 1.0)) * weight
    bias = None
    if c:
        bias_value = b.consts.get(c)
        if bias_value is None or bias_value.numel() != weight.shape[0] or bias_value.dim() > 2:
            return None  # a per-row or runtime C: keep the functional Gemm
        bias = float(attrs.get("beta", 1.0)) * bias_value.reshape(-1)
    return _linear(weight, bias)


def _matmul_module(b: _Builder, label: str, inputs: list[str], attrs: dict[str, Any]) -> nn.Module | None:
    a, w = inputs[:2]
    if a in b.consts or w not in b.consts or b.consts[w].dim() != 2:
        return None
    return _linear(b.consts[w].t(), None)


_MODULE_BUILDERS: dict[str, Callable[[_Builder, str, list[str], dict[str, Any]], nn.Module | None]] = {
    "BatchNormalization": _bn_module,
    "Conv": _conv_module,
    "Gemm": _gemm_module,
    "MatMul": _matmul_module,
}


def _unsupported(graph: onnx.GraphProto) -> str | None:
    found: dict[str, list[str]] = {}
    for i, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx"):
            op = f"{node.domain}::{node.op_type}"
        elif node.op_type not in _OPS:
            op = node.op_type
        else:
            continue
        found.setdefault(op, []).append(node.name or f"{node.op_type}_{i}")
    if not found:
        return None
    parts = [
        f"'{op}' (node '{names[0]}'" + (f", +{len(names) - 1} more)" if len(names) > 1 else ")")
        for op, names in found.items()
    ]
    noun = "operator" if len(parts) == 1 else "operators"
    return f"unsupported ONNX {noun} {', '.join(parts)}; supported: {list(SUPPORTED_OPS)}"


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    """Tensor ranks from ONNX shape inference (picks BatchNorm1d/2d/3d); empty where inference fails."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except (onnx.shape_inference.InferenceError, ValueError, RuntimeError):
        return {}
    ranks = {}
    for info in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            ranks[info.name] = len(info.type.tensor_type.shape.dim)
    return ranks


def convert_onnx(model_bytes: bytes) -> OnnxModule:
    """Convert a serialized ONNX classifier into a differentiable torch module (see the module docstring).

    Raises TeacherError for unparseable or invalid models, unsupported operators (all listed at once),
    models with more than one data input and models outside :func:`export.onnx_check.check_onnx`'s
    contract. The result is in eval mode; parameters are trainable (callers freeze teachers themselves).
    """
    source = "ONNX classifier"
    model = parse_onnx(model_bytes, source=source, error=TeacherError)
    graph = model.graph
    opsets = {o.domain: o.version for o in model.opset_import}
    opset = opsets.get("", opsets.get("ai.onnx"))
    if opset is None:
        raise TeacherError("the ONNX model imports no default-domain opset; expected e.g. opset 13..18")
    problem = _unsupported(graph)
    if problem:
        raise TeacherError(problem)
    for index, node in enumerate(graph.node):  # before the contract: its inference would refuse less clearly
        if node.op_type == "BatchNormalization":
            _check_bn(
                node.name or f"{node.op_type}_{index}", {a.name: _attr_value(a) for a in node.attribute}
            )
    names = {init.name for init in graph.initializer}
    data_inputs = [i.name for i in graph.input if i.name not in names]
    if len(data_inputs) != 1 or not graph.output:
        raise TeacherError(
            f"expected a classifier graph with one data input and an output, got inputs {data_inputs} "
            f"and {len(graph.output)} outputs"
        )
    check_onnx(model, inputs=[None], outputs=[None] * len(graph.output), source=source, error=TeacherError)
    initializers = {init.name: _tensor(init.name, init) for init in graph.initializer}
    builder = _Builder(opset, initializers, _ranks(model))
    for index, node in enumerate(graph.node):
        builder.add(node, index)
    return builder.build(data_inputs[0], graph.output[0].name).eval()
