"""The toolkit's own memory on a device: what an `edge-sdk run` process needs before any model of the budget,
per role, and which roles a profile's ``memory_mb`` can host.

A profile's budget screens the models a search may return; it says nothing about the runtime that trains
them. PyTorch alone takes a few hundred MB resident, so the smallest profiles cannot run the pipeline at all.
`edge-sdk run` (the device's own entry) checks this before it imports torch and refuses with one line;
`server-kit simulate` and :func:`edge_sdk.client.run_client` called directly (a machine standing in for the
device) do not. Stdlib only, for that reason.

The numbers are measured, not estimated: the peak RSS (``/usr/bin/time -v``) of ``edge-sdk run --role R``
in a fresh venv holding only the ``[device]`` extra (torch 2.13.0+cpu, Python 3.11.7, x86_64), on a
367-sample client of scikit-learn's digits with the default fast preset; benchmarks/RESULTS.md, "Install
size and memory per extra". They are
floors: a larger client or model needs more, and an ARM build of torch differs.
"""

from __future__ import annotations

from common.errors import ConfigError, ResourceError
from profiles import DeviceProfile

__all__ = ["RUNTIME_MB", "check_hosts", "host_role", "hosts"]

# peak RSS in MB of `edge-sdk run --role <role>` (see the module docstring for how it was measured)
RUNTIME_MB: dict[str, float] = {"classifier": 474.0, "cvae": 366.0, "both": 477.0}

# what `auto` falls back to, in order, when the role it resolved to does not fit the device's memory
_FALLBACKS: dict[str, tuple[str, ...]] = {
    "both": ("both", "classifier", "cvae"),
    "classifier": ("classifier", "cvae"),
    "cvae": ("cvae",),
}


def _check_role(role: str) -> None:
    if role not in RUNTIME_MB and role != "auto":
        raise ConfigError(f"role must be one of {['auto', *RUNTIME_MB]}, got {role!r}")


def hosts(profile: DeviceProfile, role: str) -> bool:
    """Whether the profile's ``memory_mb`` covers an `edge-sdk run` in ``role`` (``auto``: in any role)."""
    _check_role(role)
    need = min(RUNTIME_MB.values()) if role == "auto" else RUNTIME_MB[role]
    return profile.memory_mb >= need


def _refusal(profile: DeviceProfile, role: str) -> ResourceError:
    return ResourceError(
        f"profile {profile.name!r} allows {profile.memory_mb:g} MB, but `edge-sdk run` needs at least "
        f"{RUNTIME_MB[role]:g} MB in the {role} role (measured peak RSS; classifier "
        f"{RUNTIME_MB['classifier']:g} MB, cvae {RUNTIME_MB['cvae']:g} MB): run this client on a device "
        "with more memory, or pass --emulate to run it here as a stand-in for that device "
        "(as `server-kit simulate` does)"
    )


def check_hosts(profile: DeviceProfile, role: str) -> None:
    """Raise :class:`ResourceError` (one line: what it needs, what the profile allows, the fix) when the
    device cannot host an `edge-sdk run` in ``role`` (``auto``: in its smallest role)."""
    if not hosts(profile, role):
        raise _refusal(profile, min(RUNTIME_MB, key=RUNTIME_MB.__getitem__) if role == "auto" else role)


def host_role(profile: DeviceProfile, asked: str, resolved: str) -> str:
    """The role a device that runs the pipeline itself takes: ``resolved`` when its runtime fits the
    profile's memory; for ``asked == "auto"`` the next smaller role that fits (``both`` -> ``classifier``
    -> ``cvae``); an explicit role that does not fit raises :class:`ResourceError`."""
    _check_role(asked)
    if asked != "auto":
        check_hosts(profile, asked)
        return asked
    fallbacks = _FALLBACKS[resolved]
    for role in fallbacks:
        if hosts(profile, role):
            return role
    raise _refusal(profile, fallbacks[-1])
