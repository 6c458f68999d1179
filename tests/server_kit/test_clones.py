"""One model uploaded under several names counts once (server_kit.teachers.clones)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common.errors import BundleError
from edge_sdk.models.arch import build_model
from export.bundle import Bundle, write_bundle
from export.onnx_export import export_onnx
from server_kit.teachers import read_uploads
from server_kit.teachers.clones import weights_digest, without_clones

SHAPE = (1, 8, 8)


def _bundle(model: torch.nn.Module, spec: str, **fields) -> Bundle:
    base = dict(
        kind="classifier",
        model_onnx=export_onnx(model, SHAPE, metadata={"arch": spec}),
        arch=spec,
        num_classes=3,
        input_shape=SHAPE,
        label_counts=[5, 5, 5],
        num_examples=15,
        profile={"name": "test-device"},
        metrics={},
        seed=0,
        sdk_version="test",
    )
    return Bundle(**(base | fields))


def test_copies_of_one_model_under_other_names_and_manifests_count_once(tmp_path):
    torch.manual_seed(0)
    model, other = build_model("C4k3-P-F3", SHAPE, 3).eval(), build_model("C4k3-P-F3", SHAPE, 3).eval()
    first = _bundle(model, "C4k3-P-F3")
    # the same weights, exported again with other metadata, another claim and another seed
    onnx = export_onnx(model, SHAPE, metadata={"arch": "C4k3-P-F3", "note": "x"})
    copy = _bundle(model, "C4k3-P-F3", label_counts=[9, 9, 9], num_examples=27, seed=7, model_onnx=onnx)
    assert copy.model_onnx != first.model_onnx
    assert weights_digest(copy.model_onnx) == weights_digest(first.model_onnx)
    paths = [
        str(write_bundle(b, tmp_path / f"{name}.bundle"))
        for name, b in (("a", first), ("b", _bundle(other, "C4k3-P-F3")), ("c", copy), ("d", first))
    ]
    uploads = read_uploads(paths)
    skipped: list[tuple[str, str]] = []
    kept = without_clones(uploads, on_error="skip", skipped=skipped)
    assert [str(p) for p, _ in kept] == paths[:2]
    assert [s for s, _ in skipped] == paths[2:] and all("same weights as" in r for _, r in skipped)
    with pytest.raises(BundleError, match=r"c\.bundle: has the same weights as .*a\.bundle"):
        without_clones(uploads, on_error="stop", skipped=[])
    # a decoder and a classifier are compared within their kind only
    decoder = SimpleNamespace(kind="cvae_decoder", model_onnx=uploads[0][1].model_onnx)
    assert len(without_clones([uploads[0], (uploads[1][0], decoder)], on_error="stop", skipped=[])) == 2
