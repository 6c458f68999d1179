"""Decoder bundles on the server: loading (rebuilt / onnxruntime), the sample split, centroid filtering."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgpack
import numpy as np
import onnx
import pytest
import torch
from torch import nn

from common.errors import BundleError, ConfigError, TeacherError
from edge_sdk.artifacts import TrainedCVAE, bundle_cvae
from edge_sdk.cvae import Decoder, build_cvae
from export.bundle import Bundle, bundle_from_bytes, bundle_to_bytes, read_bundle
from export.onnx_export import onnx_session
from export.wire import canonical_sha256
from profiles import load_profile
from server_kit.synthesis import decoders as decoders_module
from server_kit.synthesis.decoders import (
    OnnxDecoder,
    allocate_samples,
    filter_by_centroid,
    load_decoder,
    sample_decoders,
)
from tests.export.test_onnx_check import external_weight, loop_in_front

SHAPE = (1, 6, 6)
COUNTS = (3, 0, 5, 2)


def decoder_bundle(
    tmp_path: Path,
    name: str = "d.bundle",
    seed: int = 0,
    counts: tuple[int, ...] = COUNTS,
    shape: tuple[int, int, int] = SHAPE,
    latent: int = 3,
    class_prior: bool = False,
) -> Path:
    """An untrained (seeded) cvae-small decoder bundle: enough for loading, sampling and fusion tests
    (with ``class_prior``, a prior of random means and scales stands in for a fitted one)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build_cvae("cvae-small", shape, len(counts), latent, class_prior=class_prior).eval()
        if model.decoder.prior is not None:
            model.decoder.prior.mean.normal_()
            model.decoder.prior.scale.uniform_(0.5, 1.5)
    trained = TrainedCVAE(
        module=model,
        arch=model.arch,
        num_classes=len(counts),
        input_shape=shape,
        label_counts=counts,
        num_examples=sum(counts),
        latent_dim=latent,
        metrics={"val_loss": 1.0},
    )
    bundle_cvae(trained, load_profile("wearable"), tmp_path / name, seed=seed)
    return tmp_path / name


def _ort(bundle: Bundle, z: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    return onnx_session(bundle.model_onnx).run(["x"], {"z": z.numpy(), "y": y.numpy()})[0]


@pytest.mark.parametrize("class_prior", [False, True])
def test_load_decoder_rebuilds_with_parity(tmp_path: Path, class_prior: bool) -> None:
    path = decoder_bundle(tmp_path, class_prior=class_prior)
    decoder = load_decoder(path)
    assert (decoder.prior is not None) == class_prior
    assert read_bundle(path).arch.endswith("-classprior") == class_prior
    assert isinstance(decoder, Decoder) and not decoder.training
    assert not any(p.requires_grad for p in decoder.parameters())
    assert (decoder.latent_dim, decoder.num_classes, decoder.output_shape) == (3, 4, SHAPE)
    z, y = torch.randn(5, 3, generator=torch.Generator().manual_seed(9)), torch.eye(4)[[0, 1, 2, 3, 0]]
    with torch.no_grad():
        got = decoder(z, y).numpy()
    # rebuilt torch decoder vs onnxruntime on pixels in [0, 1]: summation order costs ~1e-7, 1e-5 is ample
    assert float(np.abs(got - _ort(read_bundle(path), z, y)).max()) <= 1e-5


def test_load_decoder_falls_back_to_onnxruntime(tmp_path: Path) -> None:
    bundle = dataclasses.replace(read_bundle(decoder_bundle(tmp_path)), arch="someone-elses-decoder")
    decoder = load_decoder(bundle)
    assert isinstance(decoder, OnnxDecoder)
    z, y = torch.zeros(2, 3), torch.eye(4)[:2]
    # OnnxDecoder runs the very same onnxruntime session code on the same inputs: bitwise
    np.testing.assert_array_equal(decoder(z, y).numpy(), _ort(bundle, z, y))
    # The ONNX makes 6x6 images, the bundle says 5x5: the load-time contract refuses it before either
    # path builds or runs anything.
    wrong = dataclasses.replace(bundle, arch="cvae-small-z3", input_shape=(1, 5, 5))
    with pytest.raises(
        TeacherError, match=r"output 'x' is float32 \[1, 1, 6, 6\] .*expected float32 \[1, 1, 5, 5\]"
    ):
        load_decoder(wrong)


def test_hostile_decoders_are_refused_before_anything_is_built_or_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = read_bundle(decoder_bundle(tmp_path))

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a file that fails the contract must not be rebuilt or run")

    for name in ("build_cvae", "initializer_state_dict", "onnx_session"):
        monkeypatch.setattr(decoders_module, name, never)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.bin").write_bytes(bytes(1 << 16))
    secret = onnx.load_from_string(bundle.model_onnx)
    external_weight(secret, "secret.bin")
    looped = loop_in_front(onnx.load_from_string(bundle.model_onnx))
    for model, match in ((secret, r"external file \('secret\.bin'\)"), (looped, r"graph attribute 'body'")):
        hostile = dataclasses.replace(bundle, model_onnx=model.SerializeToString())
        with pytest.raises(TeacherError, match=match):
            load_decoder(hostile)
        with pytest.raises(TeacherError, match=match):
            OnnxDecoder(hostile.model_onnx, latent_dim=3, num_classes=4, output_shape=SHAPE)


def test_load_decoder_refuses_classifiers(tmp_path: Path) -> None:
    bundle = read_bundle(decoder_bundle(tmp_path))
    classifier = dataclasses.replace(bundle, kind="classifier", latent_dim=None)
    with pytest.raises(TeacherError, match="not a cvae_decoder"):
        load_decoder(classifier)


def test_bundle_refuses_decoder_without_latent_dim_or_label_counts(tmp_path: Path) -> None:
    bundle = read_bundle(decoder_bundle(tmp_path))
    with pytest.raises(BundleError, match="needs latent_dim"):
        dataclasses.replace(bundle, latent_dim=None)
    wire = msgpack.unpackb(bundle_to_bytes(bundle), raw=False)
    for key in ("label_counts", "latent_dim"):
        broken = {k: v for k, v in wire.items() if k != key}
        broken["sha256"] = canonical_sha256(broken)  # as a writer that hashes its own mistake would
        with pytest.raises(BundleError, match=key):
            bundle_from_bytes(msgpack.packb(broken, use_bin_type=True))


# ------------------------------------------------------------------------------------------- allocation


def test_allocate_examples_is_proportional_with_largest_remainder() -> None:
    counts = [[3, 1, 0], [0, 2, 4]]
    np.testing.assert_array_equal(allocate_samples(counts, 10), counts)  # quotas are exact
    np.testing.assert_array_equal(allocate_samples(counts, 20), [[6, 2, 0], [0, 4, 8]])
    # 10 over three equal cells: 3.33 each -> 3, 3, 3 and the leftover goes to the first (ties by index).
    np.testing.assert_array_equal(allocate_samples([[1, 1, 1]], 10), [[4, 3, 3]])
    # 5 over [2, 1] of 3: quotas 3.33 / 1.67 -> 3 / 1, leftover to the larger fraction (0.67).
    np.testing.assert_array_equal(allocate_samples([[2, 1]], 5), [[3, 2]])


def test_allocate_squared_balances_classes_and_skips_unseen() -> None:
    # Classes 0 and 1 are present (6 each of 12); class 2 is not. Class 0: 3^2 : 1^2 -> 5.4 / 0.6;
    # class 1: 1 : 1 -> 3 / 3. Floors sum to 11; the leftover goes to the largest fraction (0.6).
    cells = allocate_samples([[3, 1, 0], [1, 1, 0]], 12, weighting="squared")
    np.testing.assert_array_equal(cells, [[5, 3, 0], [1, 3, 0]])
    with pytest.raises(ConfigError, match="weighting"):
        allocate_samples([[1]], 3, weighting="cubic")
    with pytest.raises(ConfigError, match="all zero"):
        allocate_samples([[0, 0]], 3)
    with pytest.raises(ConfigError, match="total"):
        allocate_samples([[1, 1]], 0)


def test_allocate_federation_follows_every_uploads_counts() -> None:
    """Class shares follow the federation's counts (classifiers' too) over the classes the decoders hold;
    within a class, the decoders by their counts."""
    decoders = [[6, 2, 0], [2, 0, 0]]  # class 2: no decoder holds it
    # federation: class 0 = 8 of the decoders' + 12 of the classifiers'; class 1 = 2 + 18; class 2 = 50
    cells = allocate_samples(decoders, 40, weighting="federation", class_counts=[20, 20, 50])
    np.testing.assert_array_equal(cells, [[15, 20, 0], [5, 0, 0]])  # class 0: 20 split 6 : 2; class 1: 20
    examples = allocate_samples(decoders, 40)  # the paper's: class 1 gets 2 / 10 of the budget
    assert int(examples[:, 1].sum()) == 8 and int(cells[:, 1].sum()) == 20
    with pytest.raises(ConfigError, match="class_counts goes with weighting 'federation'"):
        allocate_samples(decoders, 40, weighting="federation")
    with pytest.raises(ConfigError, match="class_counts goes with weighting 'federation'"):
        allocate_samples(decoders, 40, class_counts=[1, 1, 1])
    for bad in ([1, 1], [1, float("nan"), 1], [1, -1, 1]):
        with pytest.raises(ConfigError, match="class_counts must be 3 finite counts"):
            allocate_samples(decoders, 40, weighting="federation", class_counts=bad)
    with pytest.raises(ConfigError, match="zero on every class the decoders hold"):
        allocate_samples(decoders, 40, weighting="federation", class_counts=[0, 0, 5])


class _Stamp(nn.Module):
    """A fake decoder: pixel (0, 0) = label / 10, pixel (0, 1) = client / 10, pixel (0, 2) = sigmoid(z0)."""

    def __init__(self, client: int, latent_dim: int = 2, num_classes: int = 3) -> None:
        super().__init__()
        self.client, self.latent_dim, self.num_classes, self.output_shape = (
            client,
            latent_dim,
            num_classes,
            (1, 2, 3),
        )

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = torch.zeros(len(z), 1, 2, 3)
        x[:, 0, 0, 0] = y.argmax(dim=1).float() / 10
        x[:, 0, 0, 1] = self.client / 10
        x[:, 0, 0, 2] = torch.sigmoid(z[:, 0])
        x[:, 0, 1, 0] = 5.0  # out of range: clipped to 1
        return x


def test_sample_decoders_follows_the_allocation() -> None:
    counts = [[4, 0, 2], [1, 1, 0]]
    decoders = [_Stamp(0), _Stamp(1, latent_dim=5)]
    x, y = sample_decoders(decoders, counts, total=16, num_classes=3, seed=7, batch_size=3)
    cells = allocate_samples(counts, 16)
    assert x.shape == (16, 1, 2, 3) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert float(x.max()) == 1.0 and float(x.min()) >= 0.0
    client = torch.round(x[:, 0, 0, 1] * 10).long()
    np.testing.assert_array_equal(torch.round(x[:, 0, 0, 0] * 10).long().numpy(), y.numpy())  # labels match
    for k in range(2):
        np.testing.assert_array_equal(torch.bincount(y[client == k], minlength=3).numpy(), cells[k])
    again = sample_decoders(decoders, counts, total=16, num_classes=3, seed=7)
    other = sample_decoders(decoders, counts, total=16, num_classes=3, seed=8)
    # _Stamp is elementwise, so another batch size computes the same float ops: bitwise
    assert torch.equal(again[0], x) and torch.equal(again[1], y)
    assert not torch.equal(other[0], x)
    with pytest.raises(ConfigError, match="one label-count row per decoder"):
        sample_decoders(decoders, counts[:1], total=4, num_classes=3, seed=0)
    with pytest.raises(ConfigError, match="latent_dim"):
        sample_decoders([nn.Identity()], [[1, 1, 1]], total=4, num_classes=3, seed=0)
    with pytest.raises(ConfigError, match="conditioned on"):
        sample_decoders([_Stamp(0, num_classes=4)], [[1, 1, 1]], total=4, num_classes=3, seed=0)


def test_sample_decoders_draws_a_class_from_the_decoders_that_model_it() -> None:
    """A class-prior decoder is drawn only for the classes it fitted (at least latent_dim + 1 images); a
    class no decoder models is drawn, as before priors existed, from every decoder holding it."""
    with_prior = _Stamp(0, latent_dim=2)
    with_prior.prior = nn.Identity()  # any module: what matters is that the decoder has a fitted prior
    plain = _Stamp(1, latent_dim=2)
    counts = [[30, 2, 2], [10, 6, 0]]  # class 1: only the plain decoder; class 2: nobody models it
    x, y = sample_decoders([with_prior, plain], counts, total=40, num_classes=3, seed=0)
    client = torch.round(x[:, 0, 0, 1] * 10).long()
    drawn = [[30, 0, 2], [10, 6, 0]]
    for k in range(2):
        np.testing.assert_array_equal(
            torch.bincount(y[client == k], minlength=3).numpy(), allocate_samples(drawn, 40)[k]
        )


def test_sample_decoders_temperature_scales_the_same_draw() -> None:
    counts = [[4, 0, 2]]
    x, _ = sample_decoders([_Stamp(0)], counts, total=12, num_classes=3, seed=3)
    cold, _ = sample_decoders([_Stamp(0)], counts, total=12, num_classes=3, seed=3, temperature=0.5)
    z0 = torch.logit(x[:, 0, 0, 2].double())
    # logit undoes a float32 sigmoid: its ~6e-8 relative rounding grows by 1 / (p (1 - p)), still below
    # 1e-5 for |z| < 5; 1e-4 leaves a margin and still catches a wrong temperature (a factor 2)
    torch.testing.assert_close(torch.logit(cold[:, 0, 0, 2].double()), 0.5 * z0, rtol=1e-4, atol=1e-4)
    for bad in (0.0, 1.5, float("nan"), True):
        with pytest.raises(ConfigError, match="temperature"):
            sample_decoders([_Stamp(0)], counts, total=4, num_classes=3, seed=0, temperature=bad)


def test_sample_real_decoders_from_bundles(tmp_path: Path) -> None:
    paths = [
        decoder_bundle(tmp_path, "a.bundle", seed=1),
        decoder_bundle(tmp_path, "b.bundle", seed=2, counts=(0, 4, 4, 0)),
    ]
    bundles = [read_bundle(p) for p in paths]
    decoders = [load_decoder(b) for b in bundles]
    x, y = sample_decoders(decoders, [b.label_counts for b in bundles], total=18, num_classes=4, seed=0)
    assert x.shape == (18, *SHAPE)
    assert torch.bincount(y, minlength=4).tolist() == [3, 4, 9, 2]  # (3,0,5,2) + (0,4,4,0) = 18 examples


# --------------------------------------------------------------------------------------------- filtering


def test_filter_keeps_the_nearest_fraction_per_class() -> None:
    # Class 0: ten 1-D points with mean 0, distance = |value|; 80 % -> 8 kept, the two at +-5 dropped.
    # Class 1: [10, 10, 10, 10, 20] -> mean 12, distances 2,2,2,2,8 -> floor(4.0) = 4 kept: the 10s.
    # Class 2: one point -> kept (at least one per class).
    values = [(-5, 0), (-4, 0), (-3, 0), (-2, 0), (-1, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0)]
    values += [(10, 1)] * 4 + [(20, 1), (7, 2)]
    order = np.random.default_rng(0).permutation(len(values))  # interleave the classes
    x = torch.tensor([values[i][0] for i in order], dtype=torch.float32).reshape(-1, 1, 1, 1)
    y = torch.tensor([values[i][1] for i in order])
    mask = filter_by_centroid(x, y, keep=0.8)
    kept = sorted((int(v), int(c)) for v, c in zip(x.flatten()[mask], y[mask], strict=True))
    assert kept == sorted([(v, 0) for v in (-4, -3, -2, -1, 1, 2, 3, 4)] + [(10, 1)] * 4 + [(7, 2)])


def test_filter_counts_ties_and_multidimensional_distance() -> None:
    # Eight 2-D points with mean (0, 0): four at distance 1 and four at distance 5; half -> the unit ones.
    points = [(1, 0), (0, 1), (-1, 0), (0, -1), (3, 4), (-3, -4), (4, 3), (-4, -3)]
    x = torch.tensor(points, dtype=torch.float32).reshape(8, 1, 1, 2)
    mask = filter_by_centroid(x, torch.zeros(8, dtype=torch.long), keep=0.5)
    assert mask.tolist() == [True] * 4 + [False] * 4
    # Mean 0, distances 0, 1, 1, 1, 1: floor(0.6 * 5) = 3 kept, the tie at 1 goes to earlier samples.
    ties = torch.tensor([0.0, 1.0, -1.0, 1.0, -1.0]).reshape(5, 1, 1, 1)
    assert (
        filter_by_centroid(ties, torch.zeros(5, dtype=torch.long), keep=0.6).tolist()
        == [True] * 3 + [False] * 2
    )
    # floor, as the reference's int(): 0.8 * 7 = 5.6 -> 5 (not 6); 0.1 * 7 -> 0, but a class keeps one.
    seven = torch.arange(7, dtype=torch.float32).reshape(7, 1, 1, 1)
    assert int(filter_by_centroid(seven, torch.zeros(7, dtype=torch.long), keep=0.8).sum()) == 5
    assert (
        filter_by_centroid(seven, torch.zeros(7, dtype=torch.long), keep=0.1).tolist()
        == [False] * 3 + [True] + [False] * 3
    )
    # 0.29 * 100 is 28.999... in floating point: still 29 kept.
    many = torch.arange(100, dtype=torch.float32).reshape(100, 1, 1, 1)
    assert int(filter_by_centroid(many, torch.zeros(100, dtype=torch.long), keep=0.29).sum()) == 29
    assert bool(filter_by_centroid(many, torch.zeros(100, dtype=torch.long), keep=1.0).all())
    for bad in (0.0, 1.5, True):
        with pytest.raises(ConfigError, match="keep"):
            filter_by_centroid(many, torch.zeros(100, dtype=torch.long), keep=bad)
