"""Run each fuzz case in a forked child: real consumer, time limit, memory cap, planted secret.

Why fork: a hang, a native crash or a runaway allocation kills one child, not the run, and the children
share the parent's imported torch / onnxruntime pages, so a case costs milliseconds, not an interpreter
start. Each child chdirs into a fresh ``<case>/work`` holding ``secret.bin`` (a copy sits in ``<case>``,
for ``../`` paths); an inotify watch on both, made by the parent before the fork, records any open or
read, whoever does it, so a leak is seen even when the reader never returns the bytes.

Outcomes: ``ok`` (accepted), ``refused`` (a ToolkitError), ``crash`` (any other exception), ``hang``
(past the timeout in CPU seconds, or 3x it in wall time), ``memory`` (MemoryError / bad_alloc, or peak
RSS over the cap), ``signal`` (killed by a signal), ``leak`` (a secret was opened or its bytes came
out), ``unrefused`` (accepted, but the mutant is one no reader may accept) and ``harness`` (the
harness could not build the case).
The memory cap is 2x the peak RSS of the same consumer on the honest seed, measured by this harness.
The consumers are :mod:`tests.fuzz.consumers`; cases, results and tables :mod:`tests.fuzz.cases`.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import math
import os
import resource
import select
import shutil
import signal
import struct
import tempfile
import time
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnxruntime

from common.errors import ToolkitError
from tests.fuzz import seeds as seeds_module
from tests.fuzz.cases import Case, Result
from tests.fuzz.consumers import CONSUMERS
from tests.fuzz.mutators import SeedFile, load_seed, make_mutant
from tests.fuzz.onnx_mutators import SECRET_BYTES, SECRET_CHUNK, SECRET_NAME

DEFAULT_TIMEOUT_S = 10.0  # CPU seconds per case
WALL_FACTOR = 3  # wall-clock backstop, in timeouts: slack for cores shared with other jobs
CASE_FILE = "case.file"
_MEMORY_WORDS = ("bad_alloc", "bad allocation", "failed to allocate", "out of memory", "cannot allocate")
_IN_ACCESS, _IN_OPEN = 0x1, 0x20
_REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------ the child side


def _status_kb(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    return 0


def _is_memory(err: BaseException) -> bool:
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, MemoryError) or any(w in str(seen).lower() for w in _MEMORY_WORDS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _where(err: BaseException) -> str:
    """The deepest frame of the toolkit (the code to fix) and, when elsewhere, the frame that raised."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return ""
    ours = [
        f for f in frames if Path(f.filename).resolve().is_relative_to(_REPO) and "/tests/" not in f.filename
    ]
    shown = [ours[-1]] if ours else []
    if frames[-1] not in shown:
        shown.append(frames[-1])
    return " -> ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in shown)


def _drain(fd: int) -> bool:
    """True when the inotify fd has events (it only watches the secrets)."""
    touched = False
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return touched
        if not chunk:
            return touched
        offset = 0
        while offset + 16 <= len(chunk):
            _wd, mask, _cookie, size = struct.unpack_from("iIII", chunk, offset)
            touched |= bool(mask & (_IN_ACCESS | _IN_OPEN))
            offset += 16 + size


def _secret_in(blobs: Iterable[bytes], secret: bytes) -> bool:
    chunks = [secret[i : i + 16] for i in range(0, len(secret), SECRET_CHUNK)]
    return any(chunk in blob for blob in blobs for chunk in chunks)


def _written_files(workdir: Path) -> Iterator[bytes]:
    for path in sorted(workdir.rglob("*")):
        if path.is_file() and path.name not in (SECRET_NAME, CASE_FILE):
            yield path.read_bytes()


def _child(
    case: Case,
    seed_file: SeedFile,
    seeds: seeds_module.Seeds,
    workdir: Path,
    out_fd: int,
    watch_fd: int,
    budget: Budget | None,
    timeout_s: float,
) -> None:
    """Runs in the forked child; reports one JSON record on ``out_fd`` and never returns."""
    record: dict[str, Any] = {}
    try:
        os.chdir(workdir)
        mutant = make_mutant(seed_file, case.mutator, case.seed, case.index, workdir)
        (workdir / CASE_FILE).write_bytes(mutant.data)
        record.update(note=mutant.note[:300], must_refuse=mutant.must_refuse)
    except Exception as err:  # a harness bug, reported as such
        record.update(outcome="harness", error_type=type(err).__name__, message=str(err)[:500])
        record["where"] = _where(err)
        _report(out_fd, record)
    if budget is not None:
        limit = _status_kb("VmSize") * 1024 + budget.address_space_growth
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _limit_cpu(timeout_s)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here: the consumer only
    outputs: list[bytes] = []
    started = time.perf_counter()
    try:
        outputs = CONSUMERS[case.kind](workdir / CASE_FILE, seeds, workdir)
        record["outcome"] = "ok"
    except BaseException as err:  # classifying every exception is the point
        if _is_memory(err):
            record["outcome"] = "memory"
        else:
            record["outcome"] = "refused" if isinstance(err, ToolkitError) else "crash"
        record.update(error_type=type(err).__name__, message=str(err)[:500], where=_where(err))
        outputs = [str(err).encode(errors="replace")]
    record["seconds"] = time.perf_counter() - started
    record["peak_rss_kb"] = _status_kb("VmHWM")
    record["secret_opened"] = _drain(watch_fd)
    if record["secret_opened"]:  # a file never opened cannot leak: scan only then
        secret = (workdir / SECRET_NAME).read_bytes()
        record["secret_in_output"] = _secret_in([*outputs, *_written_files(workdir)], secret)
    _report(out_fd, record)


def _cpu_seconds(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def _limit_cpu(timeout_s: float) -> None:
    """SIGXCPU after ``timeout_s`` more CPU seconds (SIGKILL one later): a hang burns CPU, and CPU time,
    unlike wall time, does not grow when other jobs share the cores."""
    soft = math.ceil(_cpu_seconds(resource.getrusage(resource.RUSAGE_SELF)) + timeout_s)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))


def _report(out_fd: int, record: dict[str, Any]) -> None:
    data = json.dumps(record).encode()
    while data:
        data = data[os.write(out_fd, data) :]
    os._exit(0)


# ----------------------------------------------------------------------------------- the parent side


@dataclass(frozen=True)
class Budget:
    """Per kind: the RSS cap (2x the honest peak) and how far the address space may grow (the honest
    growth plus one honest peak: the RLIMIT_AS backstop that keeps a 16 GiB request off the machine)."""

    rss_cap_kb: int
    address_space_growth: int


class _Watch:
    """An inotify watch on the case's secrets (ctypes: the stdlib has no binding)."""

    _libc = ctypes.CDLL(None, use_errno=True)

    def __init__(self, paths: Iterable[Path]) -> None:
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        for path in paths:
            if self._libc.inotify_add_watch(self.fd, str(path).encode(), _IN_ACCESS | _IN_OPEN) < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {path} failed")

    def close(self) -> bool:
        touched = _drain(self.fd)
        os.close(self.fd)
        return touched


@dataclass
class _Running:
    case: Case
    pid: int
    read_fd: int
    root: Path
    watch: _Watch
    deadline: float
    started: float
    buffer: bytearray = field(default_factory=bytearray)


class Runner:
    """Holds the seeds and the per-kind budgets; :meth:`run` yields one :class:`Result` per case."""

    def __init__(self, root: str | Path, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.root = Path(root)
        self.timeout_s = timeout_s
        onnxruntime.set_default_logger_severity(3)  # children inherit it: errors are in the results
        self.seeds = seeds_module.build_seeds(self.root / "seeds")
        self.seed_files = {kind: load_seed(kind, path) for kind, path in self.seeds.files.items()}
        self.budgets: dict[str, Budget] = {}

    def calibrate(self, kinds: Iterable[str] = seeds_module.KINDS) -> dict[str, Result]:
        """Run each honest seed through the harness (no cap): it must be accepted; sets the budgets."""
        honest = {}
        for kind in kinds:
            (result,) = self._run([Case(kind, "honest", 0, 0)], jobs=1, budgets=False)
            if result.outcome != "ok":
                raise RuntimeError(f"the honest {kind} seed is not accepted: {result}")
            rss_kb = int(result.extra["peak_rss_kb"])
            growth = int(result.extra["vm_growth_kb"]) * 1024 + rss_kb * 1024
            self.budgets[kind] = Budget(rss_cap_kb=2 * rss_kb, address_space_growth=growth)
            honest[kind] = result
        return honest

    def run(self, cases: list[Case], *, jobs: int = 1) -> Iterator[Result]:
        """Results in completion order (case order when ``jobs`` is 1); calibrates kinds not yet seen."""
        missing = sorted({c.kind for c in cases} - set(self.budgets))
        if missing:
            self.calibrate(missing)
        yield from self._run(cases, jobs=jobs, budgets=True)

    def _run(self, cases: Iterable[Case], *, jobs: int, budgets: bool) -> Iterator[Result]:
        pending = iter(cases)
        running: dict[int, _Running] = {}
        exhausted = False
        while running or not exhausted:
            while not exhausted and len(running) < jobs:
                case = next(pending, None)
                if case is None:
                    exhausted = True
                    break
                job = self._start(case, budgets)
                running[job.read_fd] = job
            if not running:
                break
            now = time.monotonic()
            wait = max(0.0, min(j.deadline for j in running.values()) - now)
            ready, _, _ = select.select(list(running), [], [], min(wait, 0.5))
            for fd in ready:
                job = running[fd]
                chunk = os.read(fd, 65536)
                if chunk:
                    job.buffer += chunk
                    continue
                del running[fd]
                yield self._finish(job, timed_out=False)
            now = time.monotonic()
            for fd, job in list(running.items()):
                if now >= job.deadline:
                    del running[fd]
                    os.kill(job.pid, signal.SIGKILL)
                    yield self._finish(job, timed_out=True)

    def _start(self, case: Case, budgets: bool) -> _Running:
        root = Path(tempfile.mkdtemp(prefix="case-", dir=self.root))
        workdir = root / "work"
        (workdir / "sub").mkdir(parents=True)
        secret = os.urandom(SECRET_BYTES)
        for place in (root, workdir):
            (place / SECRET_NAME).write_bytes(secret)
        watch = _Watch([root / SECRET_NAME, workdir / SECRET_NAME])
        read_fd, write_fd = os.pipe()
        budget = self.budgets.get(case.kind) if budgets else None
        seed_file = self.seed_files[case.kind]
        pid = os.fork()
        if pid == 0:  # child
            faulthandler.disable()  # a native crash is an outcome here, not a traceback on the console
            os.close(read_fd)
            try:
                if case.mutator == "honest":
                    _honest_child(case, seed_file, self.seeds, workdir, write_fd, watch.fd)
                _child(case, seed_file, self.seeds, workdir, write_fd, watch.fd, budget, self.timeout_s)
            finally:
                os._exit(70)
        os.close(write_fd)
        started = time.monotonic()
        backstop = started + WALL_FACTOR * self.timeout_s  # for hangs that sleep or block
        return _Running(case, pid, read_fd, root, watch, backstop, started)

    def _finish(self, job: _Running, *, timed_out: bool) -> Result:
        _, status, usage = os.wait4(job.pid, 0)
        os.close(job.read_fd)
        touched = job.watch.close()
        shutil.rmtree(job.root, ignore_errors=True)
        case = job.case
        result = Result(case.id, case.kind, case.mutator, outcome="hang" if timed_out else "signal")
        result.seconds = time.monotonic() - job.started
        result.peak_rss_mb = usage.ru_maxrss / 1024
        record: dict[str, Any] = {}
        if not timed_out and job.buffer:
            record = json.loads(job.buffer.decode())
        if record:
            for key in (
                "outcome",
                "note",
                "error_type",
                "message",
                "where",
                "must_refuse",
                "secret_in_output",
            ):
                if key in record:
                    setattr(result, key, record[key])
            result.peak_rss_mb = record.get("peak_rss_kb", usage.ru_maxrss) / 1024
            result.extra = {k: record[k] for k in ("peak_rss_kb", "vm_growth_kb") if k in record}
        elif not timed_out:
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            result.message = f"killed by {signal.Signals(sig).name}" if sig else f"exit status {status >> 8}"
            if sig == signal.SIGXCPU or (sig == signal.SIGKILL and _cpu_seconds(usage) >= self.timeout_s):
                result.outcome = "hang"
                result.message = f"over {self.timeout_s:g} s of CPU ({result.message})"
        else:
            result.message = f"over {WALL_FACTOR * self.timeout_s:g} s of wall time"
        result.secret_opened = touched or bool(record.get("secret_opened"))
        budget = self.budgets.get(case.kind)
        if (
            budget is not None
            and result.outcome in ("ok", "refused")
            and result.peak_rss_mb * 1024 > budget.rss_cap_kb
        ):
            result.outcome = "memory"
            cap_mb = budget.rss_cap_kb / 1024
            result.message = f"peak RSS {result.peak_rss_mb:.0f} MB > cap {cap_mb:.0f} MB; {result.message}"
        if result.secret_opened or result.secret_in_output:
            result.outcome = "leak"
        elif result.outcome == "ok" and result.must_refuse:
            result.outcome = "unrefused"
        return result


def _honest_child(
    case: Case, seed_file: SeedFile, seeds: seeds_module.Seeds, workdir: Path, out_fd: int, watch_fd: int
) -> None:
    """The calibration run: the seed itself, with the address-space growth measured too."""
    os.chdir(workdir)
    (workdir / CASE_FILE).write_bytes(seed_file.data)
    before = _status_kb("VmSize")
    Path("/proc/self/clear_refs").write_text("5")
    record: dict[str, Any] = {"note": "the honest seed"}
    try:
        CONSUMERS[case.kind](workdir / CASE_FILE, seeds, workdir)
        record["outcome"] = "ok"
    except BaseException as err:
        record.update(outcome="refused", error_type=type(err).__name__, message=str(err)[:500])
    record.update(peak_rss_kb=_status_kb("VmHWM"), vm_growth_kb=max(0, _status_kb("VmPeak") - before))
    record["secret_opened"] = _drain(watch_fd)
    _report(out_fd, record)
