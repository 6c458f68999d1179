"""heteroFedAvg (HAPFNAS section 4.3): average every supernet weight over the clients whose subnet holds it.

Clients searched their architectures in one elastic space, so each client model is a slice of the
supernet (:func:`edge_sdk.models.elastic.supernet.subnet_slices`). Every weight element v of the supernet
becomes sum_{i in S_v} |D_i| v_i / sum_{j in S_v} |D_j| over the set S_v of clients whose subnet contains v
(``num_examples`` from the bundles); elements no client holds keep the supernet's value. Each client
then gets its own subnet cut from the aggregated supernet. BatchNorm running statistics follow the
same rule; the step counters are not averaged.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from common.errors import BundleError, ConfigError
from edge_sdk.data import deploy_metadata_for
from edge_sdk.models.arch import family_of_text
from edge_sdk.models.elastic.network import ELASTIC_FAMILY
from edge_sdk.models.elastic.spec import ElasticSpec
from edge_sdk.models.elastic.supernet import SuperNet, extract, subnet_slices
from edge_sdk.models.elastic.supernet_file import load_supernet, save_supernet
from export.atomic import atomic_write_bytes, atomic_write_json
from export.bundle import Bundle, client_names, read_bundle
from export.onnx_export import export_onnx
from export.weights import initializer_state_dict
from server_kit.teachers import declared_class_names

__all__ = ["hetero_avg", "hetero_fedavg"]


def hetero_avg(
    supernet: SuperNet, clients: Sequence[tuple[ElasticSpec, dict[str, torch.Tensor], int]]
) -> SuperNet:
    """A new supernet: the per-element weighted average of the clients' (spec, state_dict, num_examples)."""
    if not clients:
        raise ConfigError("hetero_avg needs at least one client model")
    big = {k: v.clone() for k, v in supernet.max.state_dict().items()}
    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in big.items() if v.is_floating_point()}
    weight = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in total.items()}
    for spec, state, examples in clients:
        if examples < 1:
            raise ConfigError(f"num_examples must be >= 1, got {examples}")
        for key, (source, index) in subnet_slices(supernet, spec).items():
            if source not in total:  # integer buffers (num_batches_tracked): not averaged
                continue
            if key not in state or tuple(state[key].shape) != tuple(big[source][index].shape):
                raise BundleError(f"client weights for {spec} lack {key} or have the wrong shape")
            total[source][index] += examples * state[key].double()
            weight[source][index] += examples
    for key, acc in total.items():
        held = weight[key] > 0
        big[key][held] = (acc[held] / weight[key][held]).to(big[key].dtype)
    out = SuperNet(supernet.input_shape, supernet.num_classes)  # type: ignore[arg-type]
    out.max.load_state_dict(big, strict=True)
    return out.eval()


def hetero_fedavg(
    bundle_paths: Sequence[str | Path], supernet_path: str | Path, out_dir: str | Path
) -> dict[str, Any]:
    """`server-kit hetero-avg`: read the elastic client bundles, aggregate, and write
    ``<client>.onnx`` per client (names from :func:`export.bundle.client_names`) plus
    ``supernet.safetensors.msgpack`` and ``hetero_avg.json``."""
    names = client_names(bundle_paths)  # before anything is read or written
    supernet = load_supernet(supernet_path)
    out = Path(out_dir)
    bundles: list[tuple[Path, Bundle, ElasticSpec]] = []
    for path in bundle_paths:
        bundle = read_bundle(path)
        if family_of_text(bundle.arch) is not ELASTIC_FAMILY:
            raise ConfigError(f"{path}: arch {bundle.arch!r} is not a subnet of the elastic space")
        bundles.append((Path(path), bundle, ElasticSpec.parse(bundle.arch)))
    clients = []
    for _, bundle, spec in bundles:
        template = extract(supernet, spec)
        clients.append((spec, initializer_state_dict(bundle.model_onnx, template), bundle.num_examples))
    merged = hetero_avg(supernet, clients)
    labels = declared_class_names([bundle for _, bundle, _ in bundles])
    rows = []
    for name, (_, bundle, spec) in zip(names, bundles, strict=True):
        model = extract(merged, spec).eval()
        meta = {"arch": str(spec), "producer": "hetero-avg"}
        meta |= deploy_metadata_for(tuple(bundle.input_shape), bundle.num_classes, labels)  # type: ignore[arg-type]
        data = export_onnx(model, tuple(bundle.input_shape), metadata=meta)  # type: ignore[arg-type]
        target = atomic_write_bytes(out / f"{name}.onnx", data)
        rows.append(
            {"client": name, "arch": str(spec), "num_examples": bundle.num_examples, "onnx": target.name}
        )
    save_supernet(merged, out / "supernet.safetensors.msgpack", provenance={"producer": "hetero-avg"})
    report = {"clients": rows, "supernet": "supernet.safetensors.msgpack"}
    atomic_write_json(out / "hetero_avg.json", report)
    return report
