"""Device profiles: every shipped TOML, the schema's validation, and the TOML round trip."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from common.errors import ProfileError
from profiles import ROLES, DeviceProfile, list_profiles, load_profile, profile_to_toml

VALID = """\
name = "tiny"
memory_mb = 64.0
gflops = 1.5
max_flops = 1000000
max_params = 50000
"""


def shipped_text(name: str) -> str:
    return resources.files("profiles.devices").joinpath(f"{name}.toml").read_text(encoding="utf-8")


def test_at_least_eight_profiles_ship_and_one_trains_a_cvae() -> None:
    names = list_profiles()
    assert len(names) >= 8
    expected = {
        "jetson-nano-4gb",
        "jetson-orin-nano-8gb",
        "raspberry-pi-4-4gb",
        "raspberry-pi-zero-2w",
        "android-midrange",
        "android-lowend",
        "wearable",
        "laptop-cpu",
    }
    assert expected <= set(names)
    assert any(load_profile(n).role == "cvae" for n in names)


@pytest.mark.parametrize("name", list_profiles())
def test_shipped_profile_is_valid_and_documented(tmp_path: Path, name: str) -> None:
    profile = load_profile(name)
    assert profile.name == name  # the name equals the file stem
    assert profile.role in ROLES and profile.cores >= 1
    assert profile.description and profile.gflops_source
    text = shipped_text(name)
    comments = [line for line in text.splitlines() if line.startswith("#")]
    assert any("Sources:" in line for line in comments)  # vendor pages / data sheets / benchmarks, by name
    if "estimate" in profile.gflops_source:
        assert any("gflops: estimate" in line for line in comments)  # derived figures say how
    assert load_profile(write(tmp_path, profile_to_toml(profile, comments=["copy"]))) == profile


def test_budgets_restrict_mnist_search_on_small_devices() -> None:
    from edge_sdk.models.chain.spec import ChainSpec

    # A typical MNIST CNN: 21.3 MFLOP and 454.5 k params per ChainSpec.cost (= FlopCounterMode, tested).
    flops, params = ChainSpec.parse("C32k3-P-C64k5-P-F128-F10").cost((1, 28, 28))
    for name in ("raspberry-pi-zero-2w", "android-lowend", "wearable"):
        p = load_profile(name)
        assert flops > p.max_flops or params > p.max_params, name
    for name in (
        "laptop-cpu",
        "jetson-nano-4gb",
        "jetson-orin-nano-8gb",
        "android-midrange",
        "raspberry-pi-4-4gb",
    ):
        p = load_profile(name)
        assert flops <= p.max_flops and params <= p.max_params, name
    zero, pi4, laptop = (
        load_profile(n) for n in ("raspberry-pi-zero-2w", "raspberry-pi-4-4gb", "laptop-cpu")
    )
    assert zero.max_flops < pi4.max_flops < laptop.max_flops
    assert zero.max_params <= 100_000 and zero.max_flops <= 12_000_000  # a few MFLOPs, ~100 k params
    # The wearable fits FedMHO's CVAE-small: ~0.42 M params, 408 K MACs = ~0.82 MFLOP on MNIST.
    watch = load_profile("wearable")
    assert watch.role == "cvae" and watch.max_params >= 420_000 and watch.max_flops >= 2 * 408_060


def test_the_inference_cap_is_a_latency_per_image() -> None:
    # the shipped classifiers classify one image in 4 ms at their gflops: a CIFAR-sized three-stage CNN
    # (20.7 MFLOP at 32x32x3) fits every phone and board but the Pi Zero; the watch keeps 1 ms
    for name in list_profiles():
        p = load_profile(name)
        assert p.max_flops == round(p.gflops * 1e6 * p.latency_ms)
        assert p.latency_ms == (1.0 if p.role == "cvae" else 4.0), name
        keys = [line.split("=")[0].strip() for line in shipped_text(name).splitlines() if "=" in line[:20]]
        assert "latency_ms" in keys and "max_flops" not in keys, name
    assert load_profile("raspberry-pi-4-4gb").max_flops == 40_000_000


def test_a_profile_file_gives_the_cap_once(tmp_path: Path) -> None:
    latency = VALID.replace("max_flops = 1000000", "latency_ms = 2.0")
    assert load_profile(write(tmp_path, latency)).max_flops == 3_000_000  # 1.5 GFLOP/s x 2 ms
    assert load_profile(write(tmp_path, VALID)).max_flops == 1_000_000  # a file of before the rule
    with pytest.raises(ProfileError, match=r"give the inference cap once.*fix: drop max_flops"):
        load_profile(write(tmp_path, VALID + "latency_ms = 2.0\n"))
    with pytest.raises(ProfileError, match=r"latency_ms must be a positive number.*got 0"):
        load_profile(write(tmp_path, VALID.replace("max_flops = 1000000", "latency_ms = 0")))
    with pytest.raises(ProfileError, match=r"missing profile keys \['latency_ms'\]"):
        load_profile(write(tmp_path, VALID.replace("max_flops = 1000000\n", "")))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (VALID + "memory_mb = 3\n", "not valid TOML"),  # duplicate key
        ("name = \n", "not valid TOML"),
        (VALID + "max_flop = 5\n", r"unknown profile keys \['max_flop'\]; valid keys are"),
        (VALID.replace("max_params = 50000\n", ""), r"missing profile keys \['max_params'\]"),
        (VALID.replace("gflops = 1.5", "gflops = -1.5"), "gflops must be a positive number, got -1.5"),
        (VALID.replace("memory_mb = 64.0", "memory_mb = 0"), "memory_mb must be a positive number, got 0"),
        (
            VALID.replace("memory_mb = 64.0", 'memory_mb = "64"'),
            "memory_mb must be a positive number, got '64'",
        ),
        (VALID.replace("max_flops = 1000000", "max_flops = true"), "max_flops must be a positive number"),
        (VALID.replace("memory_mb = 64.0", "memory_mb = nan"), "memory_mb must be a positive number"),
        (VALID + 'role = "server"\n', r"role must be one of \('classifier', 'cvae'\), got 'server'"),
        (VALID + "cores = -2\n", "cores must be a non-negative integer"),
        (VALID + "cores = 2.5\n", "cores must be a non-negative integer"),
        (VALID.replace('name = "tiny"', 'name = ""'), "name must be a non-empty string"),
    ],
)
def test_malformed_profiles_raise_profile_error(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ProfileError, match=match):
        load_profile(write(tmp_path, text))


def test_unknown_names_and_paths(tmp_path: Path) -> None:
    with pytest.raises(
        ProfileError, match=r"unknown profile 'pi5'; expected a path .* one of \['android-lowend'"
    ):
        load_profile("pi5")
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "missing.toml")
    assert load_profile(write(tmp_path, VALID)).cores == 0  # optional fields take their defaults


def test_profile_to_toml_round_trips_awkward_text(tmp_path: Path) -> None:
    profile = DeviceProfile(
        name="odd",
        description='quote " backslash \\ newline \n tab \t unicode µ DEL \x7f',
        memory_mb=12.5,
        gflops=0.25,
        gflops_source="C:\\bench\\run.txt",
        max_flops=123,
        max_params=45,
        role="cvae",
        time_budget_s=60,
        cores=3,
    )
    text = profile_to_toml(profile, comments=["measured here", "two\nlines"])
    assert text.startswith("# measured here\n# two\n# lines\n")
    assert load_profile(write(tmp_path, text)) == profile
