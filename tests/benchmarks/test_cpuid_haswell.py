"""benchmarks/cpuid_haswell.c, the CPU-class emulation of the int8 rows: under it a process must see
Haswell's features (AVX2, FMA; no AVX-512, no VNNI), and a real segmentation fault must still crash.

Runs only where it can: a C compiler and a CPU whose kernel offers CPUID faulting."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2] / "benchmarks" / "cpuid_haswell.c"


def _cpuid_faulting() -> bool:
    try:
        return " cpuid_fault" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None or not _cpuid_faulting(), reason="needs gcc and a CPU with CPUID faulting"
)


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shim") / "cpuid_haswell.so"
    command = ["gcc", "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-o", str(out), str(SOURCE)]
    subprocess.run(command, check=True)
    return out


def _run(code: str, shim: Path) -> subprocess.CompletedProcess[str]:
    env = {"LD_PRELOAD": str(shim), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_numpy_sees_haswell(shim: Path) -> None:
    code = (
        "from numpy._core._multiarray_umath import __cpu_features__ as f; "
        "print(*(int(f[k]) for k in ('AVX2', 'FMA3', 'AVX512F', 'AVX512BW', 'AVX512VNNI', 'AVX512_SPR')))"
    )
    done = _run(code, shim)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1", "0", "0", "0", "0"]


def test_a_real_fault_still_crashes(shim: Path) -> None:
    # the handler takes only faulting cpuid instructions; anything else must end the process as before
    done = _run("import ctypes; ctypes.string_at(0)", shim)
    assert done.returncode == -11, (done.returncode, done.stderr)
