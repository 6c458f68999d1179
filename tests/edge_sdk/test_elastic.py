"""HAPFNAS pieces: the elastic space, supernet slicing/extraction, supernet file, evolution, heteroFedAvg."""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np
import pytest
import torch

from common.errors import BundleError, SpecError
from edge_sdk.models.arch import build_model, parse_arch
from edge_sdk.models.elastic.space import crossover, encode, mutate, sample_elastic
from edge_sdk.models.elastic.spec import SPACE, ElasticSpec, cost_of, largest, smallest
from edge_sdk.models.elastic.supernet import SuperNet, extract
from edge_sdk.models.elastic.supernet_file import load_supernet, save_supernet
from edge_sdk.profiling import count_flops
from edge_sdk.search import search
from edge_sdk.strategies.supernet_proxy import recalibrate_bn
from export.onnx_export import export_onnx
from server_kit.personalization.hetero_avg import hetero_avg
from server_kit.personalization.supernet import SupernetConfig, train_supernet
from tests.edge_sdk.test_search import _fast, _profile, digits  # noqa: F401

SHAPE = (1, 28, 28)


def _specs() -> list[ElasticSpec]:
    rng = np.random.default_rng(0)
    return [smallest(), largest(), *(sample_elastic(rng) for _ in range(4))]


@pytest.fixture(scope="module")
def supernet() -> SuperNet:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = SuperNet(SHAPE, 10)
    # non-trivial BatchNorm statistics, so slicing them is tested too
    net.train()
    with torch.no_grad():
        for spec in _specs():
            net(torch.rand(16, *SHAPE), spec)
    return net.eval()


@pytest.mark.parametrize("spec", _specs(), ids=str)
def test_extracted_subnet_matches_the_supernet_path(supernet, spec):
    x = torch.rand(5, *SHAPE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # sliced vs copied weights may take other conv kernels: ~1e-6 on O(1) outputs
        assert torch.allclose(supernet(x, spec), extract(supernet, spec).eval()(x), atol=1e-5)


@pytest.mark.parametrize("spec", _specs(), ids=str)
def test_spec_string_round_trip_cost_and_onnx(spec):
    assert parse_arch(str(spec)) == spec and parse_arch(spec.to_json()) == spec
    model = build_model(str(spec), SHAPE, 10).eval()
    flops, params = cost_of(spec, SHAPE, 10)
    assert flops == count_flops(model, SHAPE) and params == sum(p.numel() for p in model.parameters())
    export_onnx(model, SHAPE, metadata={"arch": str(spec)})  # validated and parity-checked inside


@pytest.mark.parametrize(
    "text",
    ["mbv3:s17-16:k3e3-24:k3e3-32:k3e3.k3e3-64:k3e3.k3e3", "mbv3:s16-16:k9e3", "mbv3:x", "mbv3:s16-16:q3"],
)
def test_bad_specs_are_refused(text):
    with pytest.raises(SpecError):
        ElasticSpec.parse(text)


def test_mutation_and_crossover_stay_in_the_space():
    rng = np.random.default_rng(3)
    width = len(encode(smallest()))
    for _ in range(200):
        a, b = sample_elastic(rng), sample_elastic(rng)
        for child in (mutate(a, rng, prob=0.5), crossover(a, b, rng)):
            child.validate(SHAPE)
            assert len(encode(child)) == width
    assert len(SPACE.stages) == 4


def test_bn_recalibration_uses_local_statistics():
    model = build_model(str(smallest()), SHAPE, 10)
    from edge_sdk.data import ArrayDataset

    bright = ArrayDataset(
        torch.full((64, *SHAPE), 250, dtype=torch.uint8), torch.zeros(64, dtype=torch.long), 10
    )
    recalibrate_bn(model, bright, batches=2, batch_size=32)
    assert not model.training
    assert model.stem_bn.running_mean.abs().max() > 0.1  # moved from the reset value 0 to the data's mean


def test_supernet_file_round_trip_and_refusals(supernet, tmp_path):
    path = save_supernet(supernet, tmp_path / "s.file")
    back = load_supernet(path)
    x = torch.rand(3, *SHAPE)
    with torch.no_grad():  # the same weights through the same kernels: bitwise
        assert torch.equal(back(x, largest()), supernet(x, largest()))
    obj = msgpack.unpackb(path.read_bytes(), raw=False)
    obj["tensors"] = obj["tensors"][:-1] + bytes([obj["tensors"][-1] ^ 1])
    (tmp_path / "bad.file").write_bytes(msgpack.packb(obj, use_bin_type=True))
    with pytest.raises(BundleError, match="sha256 mismatch"):
        load_supernet(tmp_path / "bad.file")
    (tmp_path / "junk.file").write_bytes(b"\x00" * 10)
    with pytest.raises(BundleError):
        load_supernet(tmp_path / "junk.file")


def _resigned(obj: dict) -> bytes:
    """``obj`` with the weights-file hash recomputed (sha256 of the key-sorted map without it)."""
    body = {k: v for k, v in sorted(obj.items()) if k != "sha256"}
    body["manifest"] = dict(sorted(body["manifest"].items()))
    digest = hashlib.sha256(msgpack.packb(body, use_bin_type=True, use_single_float=False)).hexdigest()
    return msgpack.packb({**body, "sha256": digest}, use_bin_type=True)


def test_supernet_manifest_is_hashed_and_bounded(supernet, tmp_path):
    """Schema 1 hashed the tensors only and read num_classes / input_shape unchecked into allocations."""
    obj = msgpack.unpackb(save_supernet(supernet, tmp_path / "s.file").read_bytes(), raw=False)
    flipped = {**obj, "manifest": {**obj["manifest"], "num_classes": 11}}
    (tmp_path / "flip.file").write_bytes(msgpack.packb(flipped, use_bin_type=True))
    with pytest.raises(BundleError, match="sha256 mismatch"):
        load_supernet(tmp_path / "flip.file")
    bad = [
        ("num_classes", -1, "num_classes must be an integer in"),
        ("num_classes", True, "num_classes must be an integer .* got True"),
        ("num_classes", 2**63, "num_classes must be an integer in"),
        ("input_shape", [-1, 8, 8], r"input_shape\[0\] must be an integer in \[1, "),
        ("input_shape", ["a", 8, 8], "must map str to scalars or int lists"),
        ("input_shape", [True, 8, 8], "must map str to scalars or int lists"),
        ("input_shape", [1, 100_000, 100_000], r"C \* H \* W <= 1048576"),
        ("input_shape", None, "input_shape must be a list of integers"),
    ]
    for key, value, message in bad:
        forged = {**obj, "manifest": {**obj["manifest"], key: value}}
        (tmp_path / "bad.file").write_bytes(_resigned(forged))
        with pytest.raises(BundleError, match=r"bad\.file: .*" + message):
            load_supernet(tmp_path / "bad.file")
    (tmp_path / "v1.file").write_bytes(_resigned({**obj, "schema_version": 1}))
    with pytest.raises(BundleError, match="schema_version 1 is not supported"):
        load_supernet(tmp_path / "v1.file")
    (tmp_path / "v1.file").write_bytes(_resigned({**obj, "schema_version": True}))
    with pytest.raises(BundleError, match="schema_version True is not supported"):
        load_supernet(tmp_path / "v1.file")


def test_hetero_avg_of_identical_specs_is_fedavg(supernet):
    spec = sample_elastic(np.random.default_rng(5))
    states = []
    for k in range(2):
        with torch.random.fork_rng():
            torch.manual_seed(10 + k)
            states.append(build_model(str(spec), SHAPE, 10).state_dict())
    merged = extract(hetero_avg(supernet, [(spec, states[0], 1), (spec, states[1], 3)]), spec).state_dict()
    for key, value in merged.items():
        if value.is_floating_point():
            # a weighted mean vs three float32 roundings of |values| < 5: below 1e-6 (as in test_fedavg)
            assert torch.allclose(value, 0.25 * states[0][key] + 0.75 * states[1][key], atol=1e-6), key
    # an element only the larger subnet holds comes from that client alone
    small = smallest()
    big_state = build_model(str(largest()), SHAPE, 10).state_dict()
    tiny_state = build_model(str(small), SHAPE, 10).state_dict()
    mixed = hetero_avg(supernet, [(largest(), big_state, 1), (small, tiny_state, 1)])
    head = mixed.max.state_dict()["head.weight"]
    # a copy, and a mean of two: one rounding each, within allclose's defaults (rtol 1e-5, atol 1e-8)
    assert torch.allclose(head[:, 64:], big_state["head.weight"][:, 64:])
    assert torch.allclose(head[:, :64], (big_state["head.weight"][:, :64] + tiny_state["head.weight"]) / 2)


def test_supernet_training_follows_the_teachers():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        teachers = [build_model("C8k3-P-F10", (1, 8, 8), 10).eval() for _ in range(2)]
    x = torch.rand(64, 1, 8, 8)
    net, losses = train_supernet(
        teachers,
        x,
        input_shape=(1, 8, 8),
        num_classes=10,
        config=SupernetConfig(steps=30, batch_size=16, lr=3e-3),
    )
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    assert not net.training


@pytest.mark.parametrize("with_supernet", [False, True])
def test_evolution_respects_the_budget_and_reports_the_predictor(digits, tmp_path, with_supernet):  # noqa: F811
    train, val = digits
    knobs = dict(strategy="evolution", population=10, mutations=4, crossovers=4, generations=2, reevaluate=2)
    budget = 2_000_000
    if with_supernet:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            net = SuperNet((1, 8, 8), 10)
        knobs["supernet"] = str(save_supernet(net, tmp_path / "s.file"))
    result = search(train, val, profile=_profile(max_flops=budget), config=_fast(**knobs), seed=0)
    trained = [e for e in result.evaluations if e.rejected is None]
    assert trained and all(e.flops <= budget for e in trained)
    assert result.details["initial_population"] >= 3 and result.details["explored"] >= len(trained)
    assert set(result.details["predictor_heldout"]) >= {"spearman", "kendall"}
    assert result.best_spec.startswith("mbv3:") == with_supernet
    assert (result.candidate_epochs == 0) == with_supernet  # the supernet proxy trains nothing
