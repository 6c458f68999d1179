"""The device configs' command-line options that both CLIs build: ``edge-sdk run`` and ``server-kit
simulate`` (whose devices run the same pipeline) share the search and CVAE selectors, the argument
groups of a device's options and the configs built from them. The configs' modules are imported when a
parser is built, not when this module is (the CLIs' start-up time)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from common.cli import renamed_option
from common.configs import config_from_dict

__all__ = [
    "add_cvae_preset",
    "add_search_selectors",
    "client_groups",
    "cvae_config",
    "search_classes",
    "search_config",
]


def search_classes() -> tuple[type, ...]:
    """The config classes of the search strategies (their fields' union is the search options)."""
    from edge_sdk.search import STRATEGIES

    return tuple(strategy.config for strategy in STRATEGIES.values())


def add_search_selectors(p: argparse.ArgumentParser) -> None:
    """``--search-preset`` and ``--strategy``: not fields, they pick the search config's class and base
    values."""
    from edge_sdk.search import STRATEGIES
    from edge_sdk.strategies.base import SHARED_PRESETS

    p.add_argument(
        "--search-preset", choices=tuple(SHARED_PRESETS), help="the search's preset (default: fast)"
    )
    renamed_option(p, "--preset", "--search-preset")
    p.add_argument(
        "--strategy",
        choices=tuple(STRATEGIES),
        help="search strategy (default: pso); an option of another strategy is refused",
    )


def add_cvae_preset(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cvae-preset", help="CVAE preset: fast (the default) or a dataset name")


def client_groups(p: argparse.ArgumentParser, own: str, prefix: str = "") -> dict[str, Any]:
    """The argument groups of a device's options, by the config they set ("" its own fields, titled
    ``own``; its search's and its CVAE's, titled after ``prefix``), with the presets in theirs."""
    groups = {
        "": p.add_argument_group(own),
        "search": p.add_argument_group(f"{prefix}architecture search"),
        "cvae": p.add_argument_group(f"{prefix}CVAE (devices too small for a classifier)"),
    }
    add_search_selectors(groups["search"])
    add_cvae_preset(groups["cvae"])
    return groups


def cvae_config(args: argparse.Namespace, given: Mapping[str, Any], base: Any = None):  # -> CVAEConfig
    """The CVAE settings: ``--cvae-preset`` (or ``base``, else ``fast``) with the given ``--cvae-*``
    options (``given``: the fields given)."""
    from edge_sdk.cvae import CVAEConfig

    if base is not None and args.cvae_preset is None:
        return config_from_dict(CVAEConfig, given, what="cvae options", base=base)
    return CVAEConfig.preset(args.cvae_preset or "fast", **given)


def search_config(args: argparse.Namespace, given: Mapping[str, Any], base: Any = None):  # -> SearchConfig
    """The search settings: ``--search-preset`` (or ``base``, else ``fast``) of ``--strategy`` (or the base's,
    else pso) with the given search fields; a field of another strategy is refused."""
    from edge_sdk.search import build_search_config, replace_search_config

    options = {**given, **({"strategy": args.strategy} if args.strategy is not None else {})}
    if base is not None and args.search_preset is None:
        return replace_search_config(base, **options)
    return build_search_config(args.search_preset or "fast", **options)
