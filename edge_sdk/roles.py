"""Which role a device takes (FedMHO): ``classifier``, ``cvae`` or ``both``, from the profile's hint and
whether the smallest classifier the configured search could return, or the CVAE, fits its budget; on a
device that runs the pipeline itself, also whether the toolkit's own memory in that role fits
(:mod:`edge_sdk.footprint`)."""

from __future__ import annotations

from typing import Literal, get_args

from common.errors import ConfigError
from common.seeding import seeded
from edge_sdk.augment import is_color
from edge_sdk.cvae import CVAEConfig, cvae_cost
from edge_sdk.footprint import host_role
from edge_sdk.models.arch import ArchSpec, build_model, parse_arch, with_num_classes
from edge_sdk.models.chain.space import CHANNELS, DEFAULT_MAX_DEPTH, KERNELS
from edge_sdk.models.chain.spec import ChainSpec, Conv, Dense, Pool
from edge_sdk.models.elastic.spec import smallest
from edge_sdk.models.zoo import RANDOM_POOL
from edge_sdk.profiling import fits, profile_model
from edge_sdk.strategies.base import SearchConfig
from edge_sdk.strategies.baselines import FixedConfig
from edge_sdk.strategies.evolution import EvolutionConfig, supernet_of
from edge_sdk.strategies.pso import PSOConfig
from profiles import DeviceProfile

__all__ = ["CLIENT_ROLES", "resolve_role", "smallest_classifier"]


ClientRole = Literal["auto", "classifier", "cvae", "both"]
CLIENT_ROLES: tuple[str, ...] = get_args(ClientRole)


def smallest_classifier(
    input_shape: tuple[int, int, int], num_classes: int, search: SearchConfig
) -> ArchSpec:
    """The cheapest classifier the configured search could return: the fixed architecture for the
    ``fixed`` strategy, else the cheapest chain the sampler can draw (its narrowest 1x1 conv, as many 2x2
    poolings as the input and ``max_depth`` allow, then the head). For ``random-pool`` this is a lower
    bound: the pool's models are larger, and the search says so when none fits."""
    if isinstance(search, FixedConfig):
        spec = parse_arch(search.fixed_arch)
        return with_num_classes(spec, num_classes)
    if supernet_of(search) is not None:
        return smallest()  # the elastic space's cheapest subnet
    # random-pool draws no chains: the chain space's default depth bounds it as before the split (#19)
    max_depth = search.max_depth if isinstance(search, PSOConfig | EvolutionConfig) else DEFAULT_MAX_DEPTH
    size, pools = min(input_shape[1], input_shape[2]), 0
    while size >= 2 and pools < max_depth - 2:
        size, pools = size // 2, pools + 1
    layers = (Conv(min(CHANNELS), min(KERNELS)), *[Pool("max")] * pools, Dense(num_classes))
    return ChainSpec(layers).validate(input_shape)


def _classifier_fits(
    profile: DeviceProfile, input_shape: tuple[int, int, int], num_classes: int, search: SearchConfig
) -> str | None:
    """None when the smallest classifier fits the profile (FLOPs, parameters, training memory), else why.

    For ``random-pool`` the question is whether any pool member fits (the ablation draws only from it).
    """
    specs = [smallest_classifier(input_shape, num_classes, search)]
    if search.strategy == "random-pool":
        specs = [parse_arch(text) for text in RANDOM_POOL]
    problems = []
    for spec in specs:
        spec = with_num_classes(spec, num_classes)
        with seeded(0):  # weight values do not matter; keep the caller's RNG untouched
            model = build_model(spec, input_shape, num_classes)
        problem = fits(profile_model(model, input_shape, batch_size=search.batch_size), profile)
        if problem is None:
            return None
        problems.append(f"{spec}: {problem}")
    return f"smallest classifier {'; '.join(problems)}"


def _cvae_fits(
    profile: DeviceProfile, input_shape: tuple[int, int, int], num_classes: int, config: CVAEConfig
) -> str | None:
    """None when the whole CVAE (encoder + decoder, training memory) fits the profile, else why. At the
    config's width: a classifier device adds a decoder only at the reference's width (None), never at
    one narrowed to fit (:func:`edge_sdk.cvae.fit_width` narrows a CVAE-only device's)."""
    return fits(cvae_cost(config, input_shape, num_classes).model, profile)


def resolve_role(
    role: str,
    profile: DeviceProfile,
    input_shape: tuple[int, int, int],
    num_classes: int,
    search: SearchConfig,
    cvae: CVAEConfig | None = None,
    *,
    hosted: bool = False,
) -> str:
    """``classifier``, ``cvae`` or ``both``: an explicit role as given; ``auto`` -> ``cvae`` when the
    profile's role hint is cvae or the smallest classifier does not fit its budget, else ``both`` when
    the images are one-channel and the CVAE of ``cvae`` (default: :class:`CVAEConfig`) fits too, else
    ``classifier``. On color images (:func:`edge_sdk.augment.is_color`) a classifier device spends its
    time on the classifier alone: the small MLP decoder draws color blobs that the teachers' vote mostly
    rejects and that cost the global model accuracy (benchmarks/RESULTS.md), so the server's color
    settings do not read them; ``both`` asks for one all the same.

    ``hosted``: this process is the device (`edge-sdk run`), so the toolkit's own memory counts too
    (:func:`edge_sdk.footprint.host_role`): ``auto`` steps down to a role whose runtime fits, and a role
    that cannot fit raises ``ResourceError``. A simulation stands in for its devices and leaves it False."""
    if role not in CLIENT_ROLES:
        raise ConfigError(f"role must be one of {CLIENT_ROLES}, got {role!r}")
    resolved = role if role != "auto" else _auto_role(profile, input_shape, num_classes, search, cvae)
    return host_role(profile, role, resolved) if hosted else resolved


def _auto_role(
    profile: DeviceProfile,
    input_shape: tuple[int, int, int],
    num_classes: int,
    search: SearchConfig,
    cvae: CVAEConfig | None,
) -> str:
    if profile.role == "cvae" or _classifier_fits(profile, input_shape, num_classes, search) is not None:
        return "cvae"
    if (
        not is_color(input_shape)
        and _cvae_fits(profile, input_shape, num_classes, cvae or CVAEConfig()) is None
    ):
        return "both"
    return "classifier"
