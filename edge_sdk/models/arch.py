"""The architecture registry: every family of architecture specs, and the calls that dispatch on them.

An architecture is data: a short string that travels through search, logs, bundles and ONNX metadata, and
a builder that turns it into a torch module. Each family owns its string form, JSON form, builder and cost
in its own package (the zoo in one module); :data:`FAMILIES` lists them, and nothing else needs to know
which family a spec is of:

* ``chain`` (:mod:`.chain`): ``C32k3-P-C64k5-P-F128-F10``, every string no other family claims;
* ``zoo`` (:mod:`.zoo`): ``zoo:resnet18``, the named baseline models;
* ``elastic`` (:mod:`.elastic`): ``mbv3:s16-24:k3e4-...``, subnets of HAPFNAS's elastic space.

A family's name is also the ``kind`` of its specs' JSON form. Models take float32 pixels in [0, 1] shaped
N x C x H x W and return logits; input normalization lives inside the model. Every built model exposes its
final ``nn.Linear`` as ``model.head`` (the server reads the class-similarity matrix from it).

CVAE decoders (``cvae-small-z20``, :mod:`edge_sdk.cvae`) are not architectures of this registry: they
travel in their own bundle kind and are rebuilt by ``build_cvae``, never by :func:`build_model`.
"""

from __future__ import annotations

import re
from typing import Any, Protocol, TypeVar

from torch import nn

from common.checks import load_json
from common.errors import SpecError
from edge_sdk.models.chain.network import CHAIN_FAMILY
from edge_sdk.models.chain.spec import ChainSpec
from edge_sdk.models.elastic.network import ELASTIC_FAMILY
from edge_sdk.models.elastic.spec import ElasticSpec
from edge_sdk.models.zoo import ZOO_FAMILY, ZooSpec

__all__ = [
    "DEFAULT_FAMILY",
    "FAMILIES",
    "ArchFamily",
    "ArchSpec",
    "analytic_cost",
    "build_model",
    "family_of",
    "family_of_text",
    "parse_arch",
    "problems",
    "with_num_classes",
]

S = TypeVar("S")


class ArchFamily(Protocol[S]):
    """One family of architectures: how its specs (of type ``S``) are read, built, costed and resized."""

    @property
    def name(self) -> str:
        """The registry key, and the ``kind`` of the JSON form."""
        ...

    @property
    def prefix(self) -> str | None:
        """What starts the string form (``zoo:``); None for the default family."""
        ...

    @property
    def spec_type(self) -> type[S]:
        """The class of the family's specs (:func:`family_of` looks specs up by it)."""
        ...

    def parse(self, text: str) -> S:
        """The spec of a (stripped) string form; raises SpecError."""
        ...

    def from_json(self, text: str) -> S:
        """The spec of its JSON form; raises SpecError."""
        ...

    def build(self, spec: S, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
        """A freshly initialised module for a (C, H, W) input and ``num_classes`` outputs."""
        ...

    def cost(self, spec: S, input_shape: tuple[int, int, int], num_classes: int) -> tuple[int, int] | None:
        """Analytic (FLOPs per sample, parameters) in FlopCounterMode's convention, or None when the
        family has no formula (then count a built model)."""
        ...

    def with_num_classes(self, spec: S, num_classes: int) -> S:
        """The spec for a task of ``num_classes`` (itself where the head is sized at build time)."""
        ...

    def problems(self, spec: S, input_shape: tuple[int, int, int]) -> list[str]:
        """Every rule the spec breaks for a (C, H, W) input, before anything is built (empty: fine)."""
        ...


ArchSpec = ChainSpec | ZooSpec | ElasticSpec  # the static type of any spec: one member per family below

# Order matters only for prefixes, and no prefix is another's prefix.
FAMILIES: dict[str, ArchFamily[Any]] = {
    CHAIN_FAMILY.name: CHAIN_FAMILY,
    ZOO_FAMILY.name: ZOO_FAMILY,
    ELASTIC_FAMILY.name: ELASTIC_FAMILY,
}
MAX_ARCH_CHARS = 1 << 16  # a spec string or its JSON: the deepest real one is a few hundred characters
_LONG_NUMBER = re.compile(r"\d{10,}")
DEFAULT_FAMILY = CHAIN_FAMILY.name  # strings with no family's prefix, JSON with no family's kind

_BY_SPEC_TYPE: dict[type, ArchFamily[Any]] = {family.spec_type: family for family in FAMILIES.values()}


def family_of(spec: ArchSpec) -> ArchFamily[Any]:
    """The family a spec belongs to (by its exact type)."""
    family = _BY_SPEC_TYPE.get(type(spec))
    if family is None:
        raise SpecError(
            f"{type(spec).__name__} is not an architecture spec; expected one of "
            f"{sorted(cls.__name__ for cls in _BY_SPEC_TYPE)}"
        )
    return family


def family_of_text(text: str) -> ArchFamily[Any]:
    """The family whose string form ``text`` is written in: the one whose prefix starts it, else the default
    family (JSON forms are :func:`parse_arch`'s business). Nothing is parsed."""
    for family in FAMILIES.values():
        if family.prefix is not None and text.startswith(family.prefix):
            return family
    return FAMILIES[DEFAULT_FAMILY]


def parse_arch(text: str) -> ArchSpec:
    """Parse a spec string (``C32k3-P-F10``, ``zoo:resnet18`` or ``mbv3:...``) or its JSON form."""
    if not isinstance(text, str) or len(text) > MAX_ARCH_CHARS:
        shown = text[:80] if isinstance(text, str) else type(text).__name__
        raise SpecError(
            f"an architecture must be a str of at most {MAX_ARCH_CHARS} characters, got {shown!r}"
        )
    text = text.strip()
    if _LONG_NUMBER.search(text):
        raise SpecError(f"a number in an architecture has at most 9 digits, got {text[:80]!r}...")
    if not text.startswith("{"):
        return family_of_text(text).parse(text)
    data = load_json(text, "architecture JSON", max_bytes=MAX_ARCH_CHARS, error=SpecError)
    kind = data.get("kind", DEFAULT_FAMILY) if isinstance(data, dict) else None
    if not isinstance(kind, str) or kind not in FAMILIES:
        raise SpecError(
            f"architecture JSON must be an object whose kind is one of {sorted(FAMILIES)}, "
            f"got {str(kind)[:80]!r}"
        )
    try:
        return FAMILIES[kind].from_json(text)
    except (KeyError, TypeError, ValueError, AttributeError) as err:  # a field missing or of a wrong type
        if isinstance(err, SpecError):
            raise
        raise SpecError(
            f"malformed {kind} architecture JSON: {type(err).__name__}: {str(err)[:200]}"
        ) from None


def build_model(spec: ArchSpec | str, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Build the torch module of any valid spec for the given (C, H, W) input and class count."""
    if isinstance(spec, str):
        spec = parse_arch(spec)
    input_shape = tuple(int(v) for v in input_shape)  # type: ignore[assignment]
    return family_of(spec).build(spec, input_shape, num_classes)


def with_num_classes(spec: ArchSpec, num_classes: int) -> ArchSpec:
    """``spec`` for a task of ``num_classes``: a chain's head resized, other families' specs unchanged."""
    return family_of(spec).with_num_classes(spec, num_classes)


def problems(spec: ArchSpec, input_shape: tuple[int, int, int]) -> list[str]:
    """Every rule ``spec`` breaks for a (C, H, W) input (empty when it can be built); nothing is built."""
    return family_of(spec).problems(spec, input_shape)


def analytic_cost(
    spec: ArchSpec, input_shape: tuple[int, int, int], num_classes: int
) -> tuple[int, int] | None:
    """(FLOPs per sample, parameters) without building anything, or None where the family has no formula.

    Microseconds per call, so a search can screen candidates before building them. A chain's cost is that
    of its own head (resize it with :func:`with_num_classes` first).
    """
    return family_of(spec).cost(spec, input_shape, num_classes)
