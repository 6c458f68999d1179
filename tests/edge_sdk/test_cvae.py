"""CVAE clients: architecture cost from first principles, decoder ONNX export, training, roles, CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from common.errors import BudgetError, ConfigError, ExportError, SpecError
from edge_sdk.artifacts import decoder_bundle_path
from edge_sdk.client import ClientConfig, run_client
from edge_sdk.curves import check_curve
from edge_sdk.cvae import (
    CVAEConfig,
    build_cvae,
    class_prior_min_examples,
    cvae_loss,
    evaluate_cvae,
    fit_class_prior,
    fit_width,
    modeled_label_counts,
    parse_cvae_arch,
    profile_cvae,
    train_cvae,
)
from edge_sdk.data import ArrayDataset, load_dataset, save_client_data
from edge_sdk.roles import resolve_role, smallest_classifier
from edge_sdk.strategies.baselines import FixedConfig
from edge_sdk.strategies.pso import PSOConfig
from export.bundle import read_bundle
from export.onnx_export import (
    OPSET,
    check_decoder_parity,
    export_decoder_onnx,
    onnx_session,
    read_metadata,
)
from export.weights import initializer_state_dict
from profiles import DeviceProfile, load_profile
from server_kit.synthesis.decoders import load_decoder


@pytest.fixture(scope="module")
def digits() -> ArrayDataset:
    """300 scikit-learn digits (1 x 8 x 8, 10 classes): small enough for seconds of CPU."""
    return load_dataset("digits").subset(np.arange(300))


# ------------------------------------------------------------------------------------------------ cost


def _small_macs(pixels: int, k: int, z: int) -> tuple[int, int]:
    """(whole-CVAE MACs, decoder MACs) of the cvae-small MLP (hidden 256), weights only."""
    encoder = (pixels + k) * 256 + 256 * z * 2  # hidden, then mean and log-variance heads
    decoder = (z + k) * 256 + 256 * pixels
    return encoder + decoder, decoder


def _small_params(pixels: int, k: int, z: int) -> tuple[int, int]:
    encoder = (pixels + k) * 256 + 256 + 2 * (256 * z + z)
    decoder = (z + k) * 256 + 256 + 256 * pixels + pixels
    return encoder + decoder, decoder


def test_cvae_small_cost_matches_hand_count_and_paper() -> None:
    model = build_cvae("cvae-small", (1, 28, 28), 10, 2)
    cost = profile_cvae(model, batch_size=2)
    macs, decoder_macs = _small_macs(784, 10, 2)
    params, decoder_params = _small_params(784, 10, 2)
    assert cost.model.flops == 2 * macs == 816_128
    assert cost.decoder_flops == 2 * decoder_macs == 407_552
    assert cost.model.params == params == 409_364
    assert cost.decoder_params == decoder_params == 204_816
    # The paper's Table 2 lists 408.06 K for CVAE-small on MNIST: the MACs of encoder + decoder.
    assert round(cost.model.macs / 1e3, 2) == 408.06


@pytest.mark.parametrize(("shape", "k", "z"), [((3, 8, 8), 5, 4), ((1, 5, 7), 3, 1)])
def test_cvae_small_cost_scales_with_shape(shape: tuple[int, int, int], k: int, z: int) -> None:
    cost = profile_cvae(build_cvae("cvae-small", shape, k, z), batch_size=2)
    pixels = int(np.prod(shape))
    assert (cost.model.flops, cost.decoder_flops) == tuple(2 * m for m in _small_macs(pixels, k, z))
    assert (cost.model.params, cost.decoder_params) == _small_params(pixels, k, z)


def test_cvae_large_flops_match_hand_count() -> None:
    c, h, w, k, z = 1, 28, 28, 10, 20
    gh, gw = h // 4, w // 4
    encoder = (
        h * w * 64 * c * 9  # conv 3x3 c -> 64 at full size
        + h * w * 128 * 64 * 9  # conv 64 -> 128
        + (h // 2) * (w // 2) * 256 * 128 * 9  # after the first pool
        + 256 * gh * gw * 256  # flatten -> 256
        + 2 * (256 + k) * z  # mean, log-variance
    )
    decoder = (
        (z + k) * 256
        + 256 * 256 * gh * gw
        + gh * gw * 128 * 256 * 9  # transposed convs, stride 1, same size
        + (h // 2) * (w // 2) * 64 * 128 * 9
        + h * w * c * 64 * 9
    )
    model = build_cvae("cvae-large", (c, h, w), k, z)
    cost = profile_cvae(model, batch_size=1)
    assert cost.model.flops == 2 * (encoder + decoder)
    assert cost.decoder_flops == 2 * decoder
    assert encoder + decoder == 151_850_896  # vs 152.67 M in the paper's Table 2 (see the report)
    assert cost.decoder_params == 3_601_153  # the reference's 3.60 M decoder


def test_cvae_large_odd_size_and_too_small() -> None:
    model = build_cvae("cvae-large", (3, 10, 9), 4, 3)
    out = model.decoder(torch.zeros(2, 3), torch.eye(4)[:2])
    assert out.shape == (2, 3, 10, 9)
    with pytest.raises(SpecError, match="at least 4x4"):
        build_cvae("cvae-large", (1, 3, 8), 10, 2)


def test_arch_strings() -> None:
    assert parse_cvae_arch("cvae-small-z2") == ("cvae-small", 2)
    assert build_cvae("cvae-large-z20", (1, 8, 8), 10).latent_dim == 20
    for bad in ("cvae-small", "cvae-medium-z2", "cvae-small-z0", "C8k3-F10"):
        with pytest.raises(SpecError, match="not a CVAE arch"):
            parse_cvae_arch(bad)
    with pytest.raises(SpecError, match="latent_dim"):
        build_cvae("cvae-small-z2", (1, 8, 8), 10, latent_dim=3)
    with_prior = build_cvae("cvae-small-z20-classprior", (1, 8, 8), 10)
    assert with_prior.class_prior and with_prior.decoder.prior is not None
    assert with_prior.arch == "cvae-small-z20-classprior"
    assert parse_cvae_arch(with_prior.arch) == ("cvae-small", 20)
    assert build_cvae("cvae-small-z20", (1, 8, 8), 10).decoder.prior is None
    assert CVAEConfig().arch == "cvae-small-z20-classprior"  # the default fits the class prior
    assert CVAEConfig(class_prior=False).arch == "cvae-small-z20"
    assert CVAEConfig(class_prior=True).arch == "cvae-small-z20-classprior"
    assert "class_prior" not in CVAEConfig(class_prior=False).to_dict()  # older reports: no prior
    assert CVAEConfig(class_prior=True).to_dict()["class_prior"] is True
    with pytest.raises(ConfigError, match="class_prior"):
        CVAEConfig(class_prior=1)  # type: ignore[arg-type]
    # the width: written only when it is not the reference's 256, bounded before any layer is built
    narrow = build_cvae("cvae-small-w64-z20-classprior", (3, 32, 32), 10)
    assert narrow.width == 64 and narrow.decoder.hidden.out_features == 64 and narrow.class_prior
    assert narrow.arch == "cvae-small-w64-z20-classprior" and parse_cvae_arch(narrow.arch) == (
        "cvae-small",
        20,
    )
    assert build_cvae("cvae-large-w32-z4", (1, 8, 8), 10).encoder.mean.in_features == 32 + 10
    plain = CVAEConfig(class_prior=False)
    assert dataclasses.replace(plain, width=64).arch == "cvae-small-w64-z20"
    assert dataclasses.replace(plain, width=256).arch == "cvae-small-z20"
    assert "width" not in CVAEConfig().to_dict() and CVAEConfig(width=64).to_dict()["width"] == 64
    with pytest.raises(SpecError, match="width must be at most 4096"):
        build_cvae("cvae-small-w5000-z2", (1, 8, 8), 10)
    for bad in ("cvae-small-w0-z2", "cvae-small-w12345-z2", "cvae-small-z2-w64"):
        with pytest.raises(SpecError, match="not a CVAE arch"):
            parse_cvae_arch(bad)
    for width in (0, 4097, True, 2.0):
        with pytest.raises(ConfigError, match="width"):
            CVAEConfig(width=width)  # type: ignore[arg-type]


def test_fit_width_narrows_only_where_the_reference_does_not_fit() -> None:
    """32x32x3 makes the MLP's first layer four times 28x28x1's: the wearable's 500 k parameters hold the
    reference's width on MNIST and 64 on CIFAR-10's shape; a classifier device never adds a narrowed one."""
    wearable, pi4 = load_profile("wearable"), load_profile("raspberry-pi-4-4gb")
    assert fit_width(CVAEConfig(), wearable, (1, 28, 28), 10).width == 256
    assert fit_width(CVAEConfig(), wearable, (3, 32, 32), 10).width == 64
    assert fit_width(CVAEConfig(width=256), wearable, (3, 32, 32), 10).width == 256  # given: kept
    state = torch.get_rng_state()
    fit_width(CVAEConfig(), wearable, (3, 32, 32), 10)
    assert torch.equal(state, torch.get_rng_state())  # probing leaves the caller's RNG alone
    search = PSOConfig()
    assert resolve_role("auto", wearable, (3, 32, 32), 10, search) == "cvae"
    assert resolve_role("auto", pi4, (1, 28, 28), 10, search) == "both"
    assert resolve_role("auto", pi4, (3, 32, 32), 10, search) == "classifier"


# ----------------------------------------------------------------------------------------------- config


def test_config_presets_and_validation() -> None:
    mnist = CVAEConfig.preset("mnist")
    assert (mnist.epochs, mnist.lr, mnist.batch_size, mnist.model) == (30, 3e-3, 64, "cvae-small")
    assert (CVAEConfig.preset("FashionMNIST").epochs, CVAEConfig.preset("svhn").lr) == (40, 1e-3)
    assert CVAEConfig.preset("emnist", latent_dim=20).latent_dim == 20
    assert CVAEConfig.preset("fast") == CVAEConfig()
    with pytest.raises(ConfigError, match="unknown CVAE preset"):
        CVAEConfig.preset("imagenet")
    with pytest.raises(ConfigError, match="unknown CVAE options"):
        CVAEConfig.preset("fast", hidden=128)
    with pytest.raises(ConfigError, match="model must be one of"):
        CVAEConfig(model="vae")
    with pytest.raises(ConfigError, match="latent_dim"):
        CVAEConfig(latent_dim=0)
    with pytest.raises(ConfigError, match="lr"):
        CVAEConfig(lr=-1.0)
    with pytest.raises(ConfigError, match="batch_size"):
        CVAEConfig(batch_size=True)
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ConfigError, match="kl_weight"):
            CVAEConfig(kl_weight=bad)
    # kl_weight is recorded only when it is not the ELBO's 1, so older reports still match on resume
    assert "kl_weight" not in CVAEConfig().to_dict() and CVAEConfig(kl_weight=2).to_dict()["kl_weight"] == 2


# ----------------------------------------------------------------------------------------- decoder ONNX


@pytest.mark.parametrize(("model_name", "shape"), [("cvae-small", (1, 28, 28)), ("cvae-large", (3, 8, 8))])
def test_decoder_export_interface_and_parity(model_name: str, shape: tuple[int, int, int]) -> None:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_cvae(model_name, shape, 10, 3)
    data = export_decoder_onnx(
        model.decoder, latent_dim=3, num_classes=10, output_shape=shape, metadata={"arch": model.arch}
    )
    proto = onnx.load_from_string(data)
    assert [(op.domain, op.version) for op in proto.opset_import] == [("", OPSET)]
    assert [i.name for i in proto.graph.input] == ["z", "y"]
    assert [o.name for o in proto.graph.output] == ["x"]
    dims = {v.name: v.type.tensor_type.shape.dim for v in [*proto.graph.input, *proto.graph.output]}
    assert all(dims[name][0].dim_param == "batch" for name in ("z", "y", "x"))
    assert [d.dim_value for d in dims["z"][1:]] == [3]
    assert [d.dim_value for d in dims["y"][1:]] == [10]
    assert [d.dim_value for d in dims["x"][1:]] == list(shape)
    assert read_metadata(data) == {
        "arch": model.arch,
        "latent_dim": "3",
        "num_classes": "10",
        "opset": "18",
        "output_shape": json.dumps(list(shape)),
    }
    assert check_decoder_parity(model.decoder, data, latent_dim=3, num_classes=10, seed=5) == shape
    for batch in (1, 5):  # dynamic batch, against torch
        gen = torch.Generator().manual_seed(batch)
        z, y = torch.randn(batch, 3, generator=gen), torch.eye(10)[torch.arange(batch) % 10]
        (got,) = onnx_session(data).run(["x"], {"z": z.numpy(), "y": y.numpy()})
        with torch.no_grad():
            expected = model.decoder(z, y).numpy()
        assert got.shape == (batch, *shape)
        assert float(np.abs(got - expected).max()) <= 1e-4  # the export's parity bound on pixels in [0, 1]
        assert got.min() >= 0.0 and got.max() <= 1.0
    # Initializer names are the decoder's state_dict keys: the server rebuilds it exactly.
    rebuilt = build_cvae(model_name, shape, 10, 3).decoder
    rebuilt.load_state_dict(initializer_state_dict(data, rebuilt), strict=True)
    z, y = torch.randn(4, 3), torch.eye(10)[:4]
    with torch.no_grad():  # the same weights through the same torch kernels: bitwise
        assert torch.equal(rebuilt(z, y), model.decoder(z, y))


def test_decoder_parity_and_shape_failures() -> None:
    first = build_cvae("cvae-small", (1, 6, 6), 4, 2)
    other = build_cvae("cvae-small", (1, 6, 6), 4, 2)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5)
    data = export_decoder_onnx(first.decoder, latent_dim=2, num_classes=4, output_shape=(1, 6, 6))
    with pytest.raises(ExportError, match=r"max abs diff .* > atol"):
        check_decoder_parity(other.decoder, data, latent_dim=2, num_classes=4)
    with pytest.raises(ExportError, match="failed validation"):  # strict shape inference sees the Reshape
        export_decoder_onnx(first.decoder, latent_dim=2, num_classes=4, output_shape=(1, 3, 12))
    large = build_cvae("cvae-large", (1, 8, 8), 4, 2)  # Resize leaves the dims symbolic: parity checks them
    with pytest.raises(ExportError, match="output_shape"):
        export_decoder_onnx(large.decoder, latent_dim=2, num_classes=4, output_shape=(1, 4, 16))
    with pytest.raises(ExportError, match=r"torch\.onnx\.export failed"):
        export_decoder_onnx(first.decoder, latent_dim=3, num_classes=4, output_shape=(1, 6, 6))
    with pytest.raises(ExportError, match="latent_dim must be a positive int"):
        export_decoder_onnx(first.decoder, latent_dim=0, num_classes=4, output_shape=(1, 6, 6))


# --------------------------------------------------------------------------------------------- training


def test_loss_is_summed_bce_plus_kl_per_sample() -> None:
    model = build_cvae("cvae-small", (1, 3, 3), 2, 2)
    gen = torch.Generator().manual_seed(0)
    x, eps = torch.rand(4, 1, 3, 3, generator=gen), torch.randn(4, 2, generator=gen)
    y = torch.eye(2)[[0, 1, 1, 0]]
    loss, recon, kl = cvae_loss(model, x, y, eps)
    mean, logvar = model.encoder(x, y)
    std = torch.exp(0.5 * logvar)
    p = model.decoder(mean + eps * std, y)  # pixels in (0, 1)
    bce = -(x * p.log() + (1 - x) * (1 - p).log()).sum() / 4
    posterior = torch.distributions.Normal(mean, std)
    prior = torch.distributions.Normal(torch.zeros_like(mean), torch.ones_like(std))
    kl_ref = torch.distributions.kl_divergence(posterior, prior).sum() / 4
    # closed forms vs torch's BCE / Normal KL on 36 pixels and 8 latents: the same float32 values summed in
    # other orders and through log1p-style formulas, ~1e-6 relative; 1e-5 leaves a tenfold margin
    torch.testing.assert_close(recon, bce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kl, kl_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, bce + kl_ref, rtol=1e-5, atol=1e-5)
    recon_out, mean_out, _ = model(x, y, eps)  # the same modules on the same inputs: float32 defaults
    torch.testing.assert_close(recon_out, p)
    torch.testing.assert_close(mean_out, mean)


def test_training_lowers_loss_and_is_deterministic(digits: ArrayDataset) -> None:
    config = CVAEConfig(epochs=4, batch_size=32)
    state = torch.get_rng_state()
    model, history = train_cvae(digits, config=config, seed=3)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is untouched
    losses = [epoch["loss"] for epoch in history]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0]  # a change in kernels moves this by far less
    # the curve of each part: the loss of every epoch is their sum (beta = 1), both parts positive
    for epoch in history:
        assert epoch["recon"] > 0 and epoch["kl"] > 0
        # per-batch float32 sums accumulated separately: a few ulps per batch, rel 1e-5 over the epoch
        assert epoch["loss"] == pytest.approx(epoch["recon"] + epoch["kl"], rel=1e-5)
    with torch.random.fork_rng():  # the same seeded init train_cvae starts from
        torch.manual_seed(3)
        untrained = build_cvae("cvae-small", digits.input_shape, 10, 2)
    after, before = evaluate_cvae(model, digits, seed=0), evaluate_cvae(untrained, digits, seed=0)
    assert after["loss"] < before["loss"]
    # each batch's loss is recon + kl rounded once in float32 (~6e-8 relative), then summed in float64
    assert after["loss"] == pytest.approx(after["recon"] + after["kl"], rel=1e-6)
    again, _ = train_cvae(digits, config=config, seed=3)
    for (key, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), key  # the same seeded path twice: bitwise
    # beta = 1 is the ELBO itself; a larger beta trains another model, which keeps less of x in z
    beta, beta_history = train_cvae(digits, config=dataclasses.replace(config, kl_weight=4.0), seed=3)
    # the KL curve is the unweighted KL; the loss weighs it by beta
    assert beta_history[0]["loss"] == pytest.approx(  # as above: per-batch float32 sums
        beta_history[0]["recon"] + 4 * beta_history[0]["kl"], rel=1e-5
    )
    assert evaluate_cvae(beta, digits, seed=0)["kl"] < after["kl"]


def test_class_prior_fits_classes_with_enough_images(digits: ArrayDataset) -> None:
    """The prior maps N(0, I) onto each class's aggregate posterior; training itself never sees it."""
    config = CVAEConfig(epochs=2, batch_size=32, latent_dim=4, class_prior=True)
    model, losses = train_cvae(digits, config=config, seed=3)
    plain, plain_losses = train_cvae(digits, config=dataclasses.replace(config, class_prior=False), seed=3)
    assert losses == plain_losses  # the same training: the prior is fitted afterwards
    prior = model.decoder.prior
    assert prior is not None and plain.decoder.prior is None
    counts = torch.bincount(digits.y, minlength=10)
    least = class_prior_min_examples(4)
    assert least == 5 and bool((counts >= least).all())  # every digits class is fitted here
    # the fitted mean of class c is the mean of its posterior means
    x = digits.x.float() / 255
    y = torch.nn.functional.one_hot(digits.y, 10).float()
    with torch.no_grad():
        mean, _ = model.encoder(x, y)
    for c in (0, 7):
        # a mean of ~180 posterior means in another order (and another batching): ~1e-6 relative
        torch.testing.assert_close(prior.mean[c], mean[digits.y == c].mean(0), atol=1e-5, rtol=1e-4)
        chol = prior.scale[c].reshape(4, 4)
        assert torch.equal(chol, torch.tril(chol)) and bool((torch.diag(chol) > 0).all())
    # sampling: z = mean[y] + L[y] eps; the posterior path (training, evaluation) is untouched
    eps = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    onehot = torch.eye(10)[[2, 2, 5]]
    with torch.no_grad():
        z = prior(eps, onehot)
        expected = torch.stack(
            [prior.mean[c] + prior.scale[c].reshape(4, 4) @ e for c, e in zip([2, 2, 5], eps, strict=True)]
        )
        torch.testing.assert_close(z, expected)  # a 4 x 4 matrix-vector product: the float32 defaults
        torch.testing.assert_close(model.decoder(eps, onehot), torch.sigmoid(model.decoder.logits(z, onehot)))
    assert evaluate_cvae(model, digits, seed=0) == evaluate_cvae(plain, digits, seed=0)
    # a class with fewer images than the latent has dimensions keeps N(0, I), and the server skips it
    few = digits.subset(np.flatnonzero((digits.y != 3).numpy() | (np.arange(len(digits)) < 40)))
    assert 0 < int((few.y == 3).sum()) < least
    fitted = fit_class_prior(model, few)
    assert 3 not in fitted and len(fitted) == 9
    assert not prior.mean[3].any() and torch.equal(prior.scale[3].reshape(4, 4), torch.eye(4))
    counts_few = torch.bincount(few.y, minlength=10).tolist()
    assert modeled_label_counts(model.decoder, counts_few)[3] == 0
    assert modeled_label_counts(plain.decoder, counts_few) == counts_few
    with pytest.raises(ConfigError, match="no class prior"):
        fit_class_prior(plain, digits)
    # ONNX: the prior travels as two initializers and matches torch
    data = export_decoder_onnx(model.decoder, latent_dim=4, num_classes=10, output_shape=digits.input_shape)
    names = {init.name for init in onnx.load_from_string(data).graph.initializer}
    assert {"prior.mean", "prior.scale"} <= names


# ---------------------------------------------------------------------------------------- roles, client


def test_auto_role() -> None:
    search = PSOConfig()
    assert resolve_role("auto", load_profile("wearable"), (1, 28, 28), 10, search) == "cvae"
    assert resolve_role("auto", load_profile("raspberry-pi-zero-2w"), (1, 28, 28), 10, search) == "classifier"
    assert resolve_role("cvae", load_profile("laptop-cpu"), (1, 28, 28), 10, search) == "cvae"
    # a classifier profile uploads its decoder too when the CVAE also fits (the pi zero's 100 k params do not)
    assert resolve_role("auto", load_profile("laptop-cpu"), (1, 28, 28), 10, search) == "both"
    # on color images a classifier device trains its classifier alone, unless asked for both
    assert resolve_role("auto", load_profile("laptop-cpu"), (3, 32, 32), 10, search) == "classifier"
    assert resolve_role("both", load_profile("laptop-cpu"), (3, 32, 32), 10, search) == "both"
    assert resolve_role("auto", load_profile("wearable"), (3, 32, 32), 10, search) == "cvae"
    assert resolve_role("classifier", load_profile("laptop-cpu"), (1, 28, 28), 10, search) == "classifier"
    # A classifier-role profile too small for the cheapest chain the search can draw switches to cvae.
    tiny = DeviceProfile(name="tiny", memory_mb=64, gflops=1.0, max_flops=10_000, max_params=100_000)
    assert str(smallest_classifier((1, 28, 28), 10, search)) == "C8k1-P-P-P-P-F10"  # 12,704 FLOPs
    assert resolve_role("auto", tiny, (1, 28, 28), 10, search) == "cvae"
    assert str(smallest_classifier((1, 28, 28), 10, PSOConfig(max_depth=4))) == "C8k1-P-P-F10"
    fixed = FixedConfig(fixed_arch="C16k5-P-C32k5-P-F7")
    assert str(smallest_classifier((1, 28, 28), 10, fixed)) == "C16k5-P-C32k5-P-F10"
    # ~5.7 MFLOP per image: over a 4 MFLOP cap (a pi zero's 1 ms), so the fixed design cannot run there
    slow = dataclasses.replace(load_profile("raspberry-pi-zero-2w"), max_flops=4_000_000)
    assert resolve_role("auto", slow, (1, 28, 28), 10, fixed) == "cvae"
    with pytest.raises(ConfigError, match="role must be one of"):
        ClientConfig(role="generator")
    assert decoder_bundle_path("out/c.bundle") == Path("out/c.decoder.bundle")


def test_run_client_cvae_writes_decoder_bundle(digits: ArrayDataset, tmp_path: Path) -> None:
    config = ClientConfig(cvae=CVAEConfig(epochs=2, class_prior=True), seed=1)  # role auto + wearable -> cvae
    result = run_client(digits, profile=load_profile("wearable"), config=config, out=tmp_path / "w.bundle")
    assert result.role == "cvae" and result.search is None and result.extra_bundles == ()
    bundle = read_bundle(result.bundle_path)
    assert bundle.kind == "cvae_decoder" and bundle.arch == result.arch == "cvae-small-z20-classprior"
    assert bundle.latent_dim == 20 and bundle.input_shape == (1, 8, 8) and bundle.num_classes == 10
    assert bundle.num_examples == 240 and sum(bundle.label_counts) == 240  # the 80 % train split
    for key in ("train_loss", "val_loss", "val_recon", "val_kl", "flops", "params", "decoder_flops"):
        assert key in bundle.metrics, key
    prior_macs = 10 * 20 + 10 * 20 * 20 + 20 * 20  # y @ mean, y @ scale, L @ eps
    assert bundle.metrics["decoder_flops"] == 2 * (_small_macs(64, 10, 20)[1] + prior_macs)
    assert bundle.metrics["decoder_params"] < bundle.metrics["params"]
    (x,) = onnx_session(bundle.model_onnx).run(
        ["x"], {"z": np.zeros((3, 20), np.float32), "y": np.eye(10, dtype=np.float32)[:3]}
    )
    assert x.shape == (3, 1, 8, 8)
    report = json.loads(result.report_path.read_text())
    assert report["role"] == "cvae" and report["search"] is None and report["config"]["cvae"]["epochs"] == 2
    # the CVAE's curves per epoch: the loss it trained on and its two parts; the last loss is the bundle's
    assert set(report["curves"]) == {"cvae"}
    curve = check_curve(report["curves"]["cvae"], "cvae")
    assert set(curve) == {"epoch", "loss", "recon", "kl"} and curve["epoch"] == [1, 2]
    # the same number stored twice (JSON and msgpack float round trips); the parts are per-batch float32 sums
    assert curve["loss"][-1] == pytest.approx(bundle.metrics["train_loss"], rel=1e-5)
    assert curve["loss"] == pytest.approx(
        [r + k for r, k in zip(curve["recon"], curve["kl"], strict=True)], rel=1e-4
    )


def test_run_client_both_and_budget(digits: ArrayDataset, tmp_path: Path) -> None:
    search = FixedConfig(fixed_arch="C8k3-P-F10", final_epochs=1)
    config = ClientConfig(role="both", search=search, cvae=CVAEConfig(epochs=1))
    out = tmp_path / "c.bundle"
    result = run_client(digits, profile=load_profile("laptop-cpu"), config=config, out=out)
    assert result.role == "both" and result.bundle_path == out and result.search is not None
    assert result.extra_bundles == (tmp_path / "c.decoder.bundle",)
    assert (
        read_bundle(out).kind == "classifier" and read_bundle(result.extra_bundles[0]).kind == "cvae_decoder"
    )
    report = json.loads(result.report_path.read_text())
    assert report["bundle"] == "c.bundle" and report["decoder"]["bundle"] == "c.decoder.bundle"
    assert {"search", "train", "export", "cvae_train", "cvae_export"} <= set(report["seconds"])
    # both phases' curves in the one report (the fixed strategy trains its one candidate: a search curve)
    assert set(report["curves"]) == {"search", "classifier", "cvae"}
    assert [len(report["curves"][p]["epoch"]) for p in ("classifier", "cvae")] == [1, 1]
    # a CVAE-only device too small for the reference's width trains the widest that fits (8x8 digits:
    # 64 pixels, so width 32 is about 7 k parameters, 64 about 14 k); a width given is not narrowed
    small = DeviceProfile(
        name="band", memory_mb=64, gflops=1.0, max_flops=10**6, max_params=10_000, role="cvae"
    )
    narrow = run_client(
        digits, profile=small, config=ClientConfig(cvae=CVAEConfig(epochs=1)), out=tmp_path / "n"
    )
    assert read_bundle(narrow.bundle_path).arch == "cvae-small-w32-z20-classprior"
    assert load_decoder(narrow.bundle_path).hidden.out_features == 32  # the server rebuilds it at its width
    with pytest.raises(BudgetError, match=r"does not fit the device.*max_params.*--cvae-width"):
        config = ClientConfig(cvae=CVAEConfig(epochs=1, width=256))
        run_client(digits, profile=small, config=config, out=tmp_path / "x")
    tiny = dataclasses.replace(small, max_params=1_000)
    with pytest.raises(BudgetError, match=r"no CVAE width of \[256, 128, 64, 32, 16\] fits.*max_params"):
        run_client(digits, profile=tiny, config=ClientConfig(cvae=CVAEConfig(epochs=1)), out=tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_cli_run_role_cvae(digits: ArrayDataset, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from edge_sdk.cli import main

    data = tmp_path / "client.npz"
    save_client_data(data, digits)
    out = tmp_path / "c.bundle"
    argv = ["run", "--data", str(data), "--profile", "laptop-cpu", "--out", str(out), "--quiet"]
    argv += ["--role", "cvae", "--cvae-model", "cvae-small", "--cvae-latent-dim", "3", "--cvae-epochs", "1"]
    assert main([*argv, "--cvae-lr", "0.01"]) == 0
    assert "cvae_decoder" in capsys.readouterr().out
    report = json.loads(out.with_name(out.name + ".report.json").read_text())
    assert report["curves"]["cvae"]["epoch"] == [1]  # edge-sdk run's own report carries the curves
    bundle = read_bundle(out)
    assert (bundle.kind, bundle.latent_dim, bundle.metrics["lr"], bundle.metrics["epochs"]) == (
        "cvae_decoder",
        3,
        0.01,
        1,
    )
    assert main([*argv, "--cvae-preset", "imagenet"]) == 2
