"""The one device resolver."""

from __future__ import annotations

import pytest
import torch

from common.device import check_device, resolve_device
from common.errors import ConfigError


def test_auto_picks_cuda_only_when_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")


def test_names_and_devices_pass_through() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("name", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_cuda_is_refused_where_there_is_none(monkeypatch: pytest.MonkeyPatch, name: object) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="CUDA is not available; use device cpu or auto"):
        resolve_device(name)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "", None, 0, "mps"])
def test_check_device_refuses_what_is_no_device_name(name: object) -> None:
    with pytest.raises(ConfigError, match="device must be cpu, cuda, cuda:N or auto"):
        check_device(name)


def test_check_device_leaves_whether_the_machine_has_it_to_resolve_device(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("auto", "cpu", "cuda", "cuda:1"):  # a server may plan its clients' CUDA without its own
        assert check_device(name) == name
