"""Device profiles: what a device can afford for local training and inference.

A profile is a small TOML file that people write (one per device kind, sources in comments). This module
is stdlib only so it can be imported anywhere, including on the smallest device.

FLOPs follow ``torch.utils.flop_counter.FlopCounterMode``: one multiply-accumulate counts as 2 FLOPs,
and only convolutions and matrix products are counted.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from common.checks import load_toml, read_regular_file
from common.errors import ProfileError

__all__ = ["ROLES", "DeviceProfile", "list_profiles", "load_profile", "profile_to_toml"]

MAX_PROFILE_BYTES = 1 << 20  # a profile is a dozen lines
LATENCY_KEY = "latency_ms"  # a profile file's inference cap: milliseconds per image at its gflops

ROLES = ("classifier", "cvae")


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """Budgets of one device.

    Attributes:
        name: short identifier, e.g. ``"raspberry-pi-4"``.
        description: one human line.
        memory_mb: memory the device can give to local training (MB); `edge-sdk run` holds the toolkit's
            own process to it too (``edge_sdk.footprint``).
        gflops: sustained fp32 throughput (GFLOP/s) and ``gflops_source`` says where it comes from.
        max_flops: inference FLOPs per sample (2 x MACs) a model may cost. A profile file states it as
            ``latency_ms``, the longest one image's inference may take at the device's ``gflops``
            (``max_flops = gflops x 1e6 x latency_ms``): a rule a person can check against the app's
            needs. A file may give ``max_flops`` itself instead (profiles written before the rule), never
            both.
        max_params: parameter count a model may have.
        role: ``"classifier"`` (search + train a classifier) or ``"cvae"`` (train a conditional VAE).
        time_budget_s: wall-clock seconds the device may spend on local work.
        cores: CPU cores of the device, 0 when unknown (measured profiles record it; informational).
    """

    name: str
    description: str = ""
    memory_mb: float
    gflops: float
    gflops_source: str = ""
    max_flops: int
    max_params: int
    role: str = "classifier"
    time_budget_s: float = 3600.0
    cores: int = 0

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ProfileError(f"profile name must be a non-empty string, got {self.name!r}")
        for field in ("memory_mb", "gflops", "max_flops", "max_params", "time_budget_s"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ProfileError(f"profile {self.name!r}: {field} must be a positive number, got {value!r}")
        if isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 0:
            raise ProfileError(
                f"profile {self.name!r}: cores must be a non-negative integer (0 = unknown), "
                f"got {self.cores!r}"
            )
        if self.role not in ROLES:
            raise ProfileError(f"profile {self.name!r}: role must be one of {ROLES}, got {self.role!r}")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_mb * 1024 * 1024)

    @property
    def latency_ms(self) -> float:
        """The inference time per image ``max_flops`` stands for at the profile's ``gflops``."""
        return self.max_flops / (self.gflops * 1e6)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def to_file_dict(self) -> dict[str, object]:
        """The fields as a profile file states them: the inference cap as ``latency_ms``."""
        out: dict[str, object] = {}
        for key, value in self.to_dict().items():
            if key == "max_flops":
                out["latency_ms"] = self.latency_ms
            else:
                out[key] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, object], *, source: str = "<dict>") -> DeviceProfile:
        """Build a profile from a mapping, rejecting unknown keys with the list of valid ones."""
        data = _inference_cap(data, source)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            valid = sorted(fields - {"max_flops"} | {LATENCY_KEY})
            raise ProfileError(f"{source}: unknown profile keys {unknown}; valid keys are {valid}")
        required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing = sorted(LATENCY_KEY if key == "max_flops" else key for key in required - set(data))
        if missing:
            raise ProfileError(f"{source}: missing profile keys {missing}")
        try:
            return cls(**data)  # type: ignore[arg-type]
        except TypeError as err:
            raise ProfileError(f"{source}: {err}") from err


def _inference_cap(data: dict[str, object], source: str) -> dict[str, object]:
    """``data`` with a ``latency_ms`` turned into the ``max_flops`` it allows at the profile's ``gflops``;
    both given is refused (two caps that may disagree), as is a latency that is no positive number."""
    if LATENCY_KEY not in data:
        return data
    if "max_flops" in data:
        raise ProfileError(
            f"{source}: give the inference cap once, as latency_ms (per image, at gflops) or max_flops "
            f"(FLOPs per image), got both; fix: drop max_flops"
        )
    latency, gflops = data[LATENCY_KEY], data.get("gflops")
    for key, value in ((LATENCY_KEY, latency), ("gflops", gflops)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ProfileError(
                f"{source}: {key} must be a positive number (latency_ms sets max_flops = gflops x 1e6 x "
                f"latency_ms), got {value!r}"
            )
    rest = {k: v for k, v in data.items() if k != LATENCY_KEY}
    return rest | {"max_flops": max(1, round(float(gflops) * 1e6 * float(latency)))}  # type: ignore[arg-type]


def _shipped() -> dict[str, resources.abc.Traversable]:
    root = resources.files("profiles.devices")
    return {p.name[: -len(".toml")]: p for p in root.iterdir() if p.name.endswith(".toml")}


def list_profiles() -> list[str]:
    """Names of the profiles shipped with the toolkit, sorted."""
    return sorted(_shipped())


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    """Load a shipped profile by name, or any profile TOML by path."""
    path = Path(name_or_path)
    shipped = _shipped()
    if str(name_or_path) in shipped:
        text = shipped[str(name_or_path)].read_text(encoding="utf-8")
        source = f"profile {name_or_path!r}"
    elif path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ProfileError(f"profile file {path} does not exist; shipped profiles: {list_profiles()}")
        source = str(path)
        raw = read_regular_file(path, max_bytes=MAX_PROFILE_BYTES, what="profile file", error=ProfileError)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ProfileError(f"{source} must be UTF-8 TOML, got undecodable bytes ({err.reason})") from None
    else:
        raise ProfileError(
            f"unknown profile {str(name_or_path)!r}; "
            f"expected a path to a .toml file or one of {list_profiles()}"
        )
    data = load_toml(text, source, max_bytes=MAX_PROFILE_BYTES, error=ProfileError)
    return DeviceProfile.from_dict(data, source=source)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    # JSON string escapes are valid TOML basic-string escapes; TOML also forbids a raw DEL.
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def profile_to_toml(profile: DeviceProfile, *, comments: list[str] | None = None) -> str:
    """Render a profile as TOML (the same schema ``load_profile`` reads)."""
    lines = [f"# {line}".rstrip() for comment in comments or [] for line in comment.splitlines() or [""]]
    lines += [f"{key} = {_toml_value(value)}" for key, value in profile.to_file_dict().items()]
    return "\n".join(lines) + "\n"
