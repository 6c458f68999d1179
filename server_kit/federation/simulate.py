"""A whole one-shot federation in one call: partition -> every client as a device -> aggregate -> evaluate.

Each client's role follows its profile (``edge-sdk run --role auto``): classifier profiles search and
train a classifier and, on one-channel images where it fits, a CVAE whose decoder they upload too (role
``both``; :func:`edge_sdk.roles.resolve_role` says why not on color images); ``cvae``
profiles (FedMHO's constrained devices) train only the CVAE. Every decoder bundle goes to the server with
the classifiers, where the default synthesis samples it.

Clients run through `edge_sdk.client.run_client` (the code path of `edge-sdk run`) and the server through
`server_kit.aggregate.aggregate` (the code path of `server-kit aggregate`), so a simulation measures the
real toolkit.

Resume (``resume``, `--resume`): a rerun into the same ``out_dir`` reuses only what provably belongs to the
run it would do now, and logs one line per client saying which it reused and which it redid and why.
``data/`` is reused when ``partition.json`` records the same partition settings
(:func:`edge_sdk.data.partition_settings`); a client's bundles when the :func:`edge_sdk.client.resume_key`
its report records (its settings, the content hash of its data file, its device's budgets, the code
version) equals the one of this run; the server's inversion chunks (``server/synthetic/``) when
``server/inputs.json`` records the same inversion settings and upload hashes (:func:`_server_key`).
``auto`` redoes the rest, ``strict`` refuses a directory holding files made with other settings (one line
naming them), ``off`` redoes everything.
Files are named by :func:`edge_sdk.data.client_name` (``client_00``, ``client_000`` from 100 clients on).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from common.checks import (
    check_int,
    check_number,
    check_real_dir,
    check_str,
    from_preset,
    is_number,
    load_toml,
    make_real_dir,
    read_regular_file,
)
from common.configs import MAX_CONFIG_BYTES, config_from_dict
from common.device import check_device, resolve_device
from common.errors import ConfigError
from common.timing import timed
from edge_sdk.client import CODE_VERSION, ClientConfig, plan_run, resume_key, run_client
from edge_sdk.cvae import CVAEConfig
from edge_sdk.data import (
    ArrayDataset,
    check_image_size,
    client_name,
    load_client_data,
    partition,
    partition_settings,
)
from edge_sdk.image_cache import cache_dir
from edge_sdk.precision import Precision, check_precision
from edge_sdk.profiling import usable_threads
from edge_sdk.roles import resolve_role
from edge_sdk.search import search_config_from_dict
from edge_sdk.shared_init import write_initial_weights
from edge_sdk.strategies.base import SearchConfig
from edge_sdk.strategies.baselines import FixedConfig
from edge_sdk.strategies.pso import PSOConfig
from edge_sdk.train import release_memory, to_float
from export.atomic import atomic_write_json, to_json
from export.bundle import read_bundle
from profiles import load_profile
from server_kit.aggregate import aggregate
from server_kit.aggregate_config import AggregateConfig
from server_kit.evaluate import evaluate_onnx
from server_kit.federation.resume import (
    Verdict,
    client_verdict,
    partition_verdict,
    prepare_server,
    refuse,
    uploads_of,
)
from server_kit.federation.workers import worker_pool
from server_kit.labelling.ceilings import teacher_ceilings
from server_kit.report import write_report
from server_kit.teachers import Federation, split_kinds, without_clones
from server_kit.teachers.loading import read_uploads, teachers_from_bundles
from server_kit.training import FusionConfig

__all__ = [
    "DEFAULT_FLEET",
    "RESUME_MODES",
    "ClientPlan",
    "SimulateConfig",
    "SimulateResult",
    "assign_profiles",
    "plan_clients",
    "simulate",
]

# what a rerun into the same out_dir does with the files of an earlier run (see the module docstring)
ResumeMode = Literal["auto", "strict", "off"]
RESUME_MODES: tuple[str, ...] = get_args(ResumeMode)

logger = logging.getLogger("server_kit")  # the lines shown while the clients' bar runs (tqdm redirects it)
log = logging.getLogger(__name__)  # the resume decisions, before the bar; through server_kit's handler


MAX_CLIENTS = 100_000  # clients of one simulated federation (and worker processes)
MAX_SIMULATE_SEED = 2**62  # client k runs with seed + k: the sum stays a 64-bit seed
# the default fleet, assigned round-robin (SimulateConfig says why these)
DEFAULT_FLEET = ("laptop-cpu", "jetson-nano-4gb", "android-midrange", "raspberry-pi-4-4gb", "wearable")


@dataclass(frozen=True, kw_only=True)
class SimulateConfig:
    """A simulated federation. Client ``k`` gets profile ``profiles[k % len(profiles)]`` unless
    ``profile_map`` (a TOML file: ``default = "name"`` and a ``[clients]`` table ``3 = "name"``) says
    otherwise.

    The default fleet (:data:`DEFAULT_FLEET`) is the model-heterogeneous federation the toolkit is for:
    classifier devices whose budgets span an order of magnitude (a laptop, a Jetson Nano, a mid-range
    phone, a Raspberry Pi 4: each searches under its own budget) and a CVAE-only wearable
    (FedMHO's constrained device, uploading a decoder alone), so ten clients are two of each. A fleet
    of one profile gives every client the same budget and role, and never exercises what the server
    does with teachers of different sizes and with devices that send a decoder alone. The other
    shipped profiles (the Jetson Orin, the low-end phone, the Pi Zero) lie beyond the ends of this
    range and are one ``profiles`` away.
    """

    # the dataset to partition: mnist, fashionmnist, cifar10, svhn, digits, or folder (your own images)
    dataset: str
    # the dataset's root (not needed for digits): torchvision's layout, a folder holding
    # cifar10-jpeg.tar.gz, or for folder, a folder (or .tar.gz) with train/<class>/ and test/<class>/
    data_root: str | None = None
    # folder only: every image scaled and centre-cropped to this square size (else all must share one size)
    image_size: int | None = None
    num_clients: int = 10  # clients in the federation
    alpha: float = 0.5  # Dirichlet concentration of the label skew
    seed: int = 0  # seed of the partition, the clients (seed + k) and the server
    out_dir: Path
    profiles: tuple[str, ...] = DEFAULT_FLEET  # device profiles, assigned round-robin
    # a TOML file of profiles per client: default = 'name' and a [clients] table of index = 'name'
    profile_map: Path | None = None
    search: SearchConfig = field(default_factory=PSOConfig)
    cvae: CVAEConfig = field(default_factory=CVAEConfig)  # clients whose profile role is cvae (FedMHO)
    unknown_output: bool = False  # classifier clients train FedOV's "unknown" output
    # classifier devices also train and upload a CVAE decoder where their role resolves to both (one-channel
    # images, where it fits); False:
    # they upload their classifier alone (FedMHO's setting), constrained devices still train CVAEs
    decoders: bool = True
    # when every classifier client trains one architecture (strategy fixed), the server publishes initial
    # weights of it (init.onnx in the output directory) and the clients start from them, so their uploads
    # can be averaged (FedMHO's FedAvg initialisation); False: each client initialises its own
    shared_init: bool = True
    # the clients' training precision: bfloat16 autocast where the hardware has it (auto), or as given;
    # on the command line the server's follows it unless its own is given
    precision: Precision = "auto"
    aggregate: AggregateConfig = field(default_factory=AggregateConfig)
    val_fraction: float = 0.2  # share of each client's data held out for its validation
    min_size: int = 10  # fewest examples a client gets
    jobs: int = 1  # clients trained in parallel processes
    # the clients' training device: auto (CUDA when present), cpu, cuda or cuda:N; the server has its own
    device: str = "auto"
    progress: bool = True
    # auto: reuse the partition, client bundles and inversion chunks made with this run's settings, data and
    # code, redo the rest; strict: refuse an output directory holding any made otherwise; off: redo all
    resume: ResumeMode = "auto"

    def __post_init__(self) -> None:
        self._check_scalars()
        # the dataset and the split are checked here, not after seconds of partitioning
        partition_settings(
            self.dataset,
            num_clients=self.num_clients,
            alpha=self.alpha,
            seed=self.seed,
            min_size=self.min_size,
        )
        if not isinstance(self.aggregate, AggregateConfig):
            raise ConfigError(f"aggregate must be an AggregateConfig, got {type(self.aggregate).__name__}")
        if self.aggregate.seed != self.seed:  # one seed: the server's is the federation's
            object.__setattr__(self, "aggregate", dataclasses.replace(self.aggregate, seed=self.seed))
        if self.resume not in RESUME_MODES:
            raise ConfigError(
                f"resume must be one of {RESUME_MODES}, got {self.resume!r}; auto reuses what matches"
            )
        if self.jobs < 1:
            raise ConfigError(f"jobs must be >= 1, got {self.jobs}")
        check_precision(self.precision)
        check_image_size(self.dataset, self.image_size)
        for name in ("decoders", "shared_init"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not self.profiles and self.profile_map is None:
            raise ConfigError("give at least one profile (profiles=...) or a profile_map TOML")
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.profile_map is not None:
            object.__setattr__(self, "profile_map", Path(self.profile_map))

    def _check_scalars(self) -> None:
        """Types and ranges of the plain fields, before anything uses them (a config file may hold any
        JSON / TOML / YAML value in any of them)."""
        check_str("dataset", self.dataset, max_bytes=256)
        check_int("num_clients", self.num_clients, 1, MAX_CLIENTS)
        check_int("seed", self.seed, 0, MAX_SIMULATE_SEED)
        check_int("min_size", self.min_size, 0)
        check_int("jobs", self.jobs, 1, MAX_CLIENTS)
        check_number("alpha", self.alpha, positive=True)
        if not is_number(self.val_fraction) or not 0 < self.val_fraction < 1:  # type: ignore[operator]
            raise ConfigError(f"val_fraction must be in (0, 1), a number, got {self.val_fraction!r}")
        for name in ("out_dir", "profile_map", "data_root"):
            value = getattr(self, name)
            if not (value is None and name != "out_dir") and not (
                isinstance(value, str | Path) and str(value)
            ):
                raise ConfigError(f"{name} must be a non-empty path, got {value!r}")
        for name in ("progress", "unknown_output"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        check_device(self.device)
        profiles = self.profiles if isinstance(self.profiles, tuple | list) else None
        if profiles is None or not all(isinstance(p, str) and p for p in profiles):
            raise ConfigError(f"profiles must be a list of profile names, got {self.profiles!r}")

    @classmethod
    def preset(cls, name: str, *, dataset: str, out_dir: Path | str, **fields: Any) -> SimulateConfig:
        """``default`` (every field's default) or ``fedmho``, with any field given by keyword.

        ``fedmho`` is FedMHO's setting (section 5.1, Table 3): classifier and CVAE devices alternate
        (``laptop-cpu``, ``wearable``: 5 + 5 of 10 clients); the classifier devices upload their
        classifier alone, all of one architecture (:data:`FEDMHO_ARCH`, within the laptop's budget; the
        paper's VGG-9 is not: 126 MFLOPs) trained from the server's shared initial weights; the CVAE
        devices train cvae-small with the dataset's Table 3 settings (MNIST and Fashion at lr 3e-3, see
        :mod:`edge_sdk.cvae`); the server initialises the global model by FedAvg of the classifiers and
        fuses it on the filtered decoder samples with FedMHO-MD (the dataset's Table 3 global epochs and
        learning rate, lambda 0.5, the ``conditioned`` teacher of :mod:`server_kit.training.fusion`; 12,000
        samples for EMNIST, 6,000 otherwise). ``aggregate=...`` replaces the server's settings whole
        (e.g. ``fusion`` mode sd).
        """
        presets: dict[str, dict[str, Any]] = {"default": {}, "fedmho": _fedmho_fields(dataset)}
        return from_preset(cls, presets, name, "simulate", dataset=dataset, out_dir=out_dir, **fields)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["search"] = self.search.to_dict()  # the strategy's name is no field of its config
        data["out_dir"] = str(self.out_dir)
        data["profile_map"] = str(self.profile_map) if self.profile_map else None
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SimulateConfig:
        """The inverse of :meth:`to_dict` (``from_dict(to_dict(c)) == c``, also through JSON), and the
        table of a TOML file a person wrote: keys are the fields, nested tables the nested configs
        (``[search]`` with its ``strategy``, ``[cvae]``, ``[aggregate]``, ``[aggregate.distill]``, ...);
        a key left out keeps its default, an unknown one is refused with the valid ones. What it
        replays is what was asked: ``precision = "auto"`` resolves again on the machine that replays.
        The server's seed is ``seed``: a table whose ``[aggregate]`` names another is refused."""
        server = data.get("aggregate")
        if isinstance(server, Mapping) and "seed" in server and server["seed"] != data.get("seed", 0):
            raise ConfigError(
                f"aggregate.seed is the federation's seed, got seed {data.get('seed', 0)!r} and "
                f"aggregate.seed {server['seed']!r}; fix: drop aggregate.seed (seed seeds the partition, "
                "the clients and the server)"
            )
        return config_from_dict(cls, data, what="config", builders={"search": search_config_from_dict})


# FedMHO's classifier architecture here: CNN1 (pFedZKD's MNIST CNN), 21 MFLOPs at 28x28, within every
# classifier profile that is not a phone's low end; the paper's VGG-9 (126 MFLOPs) fits none of them
FEDMHO_ARCH = "C32k5-P-C64k5-P-F10"
FEDMHO_EPOCHS = 10  # local epochs of the classifiers (the paper: 200, insensitive above 50, Fig. 7)
# FedMHO's decoders carry a class prior (edge_sdk.cvae.ClassPrior) and are drawn at temperature 0.9, the
# higher of the two measured (1, 0.9) at which every class of the MNIST server sets is recognisable, at
# little cost to the global model (benchmarks/RESULTS.md, "FedMHO at the paper's numbers"). Their budget
# is split over classes by every upload's label counts ("federation"): the fusion trains on decoder
# samples alone, so a class the CVAE devices hold little of would otherwise get almost none, however much
# of it the classifiers hold.
FEDMHO_TEMPERATURE = 0.9


def _fedmho_fields(dataset: str) -> dict[str, Any]:
    """The fields of the ``fedmho`` preset for ``dataset`` (its Table 3 row where the paper has one)."""

    def table3(factory: Any, **extra: Any) -> Any:
        try:
            return factory(dataset, **extra)
        except ConfigError:  # a dataset the paper does not tune (digits, cifar10 fusion): ours
            return factory("fast", **extra)

    return {
        "profiles": ("laptop-cpu", "wearable"),
        "decoders": False,
        "shared_init": True,
        "search": FixedConfig(fixed_arch=FEDMHO_ARCH, final_epochs=FEDMHO_EPOCHS),
        "cvae": table3(CVAEConfig.preset, class_prior=True),
        "aggregate": AggregateConfig(
            synth=("decoder",),
            fusion=table3(FusionConfig.preset, mode="md"),
            fedavg_init=True,
            decoder_samples=12_000 if dataset.lower() == "emnist" else 6_000,
            decoder_temperature=FEDMHO_TEMPERATURE,
            decoder_weighting="federation",
        ),
    }


def assign_profiles(num_clients: int, profiles: tuple[str, ...], profile_map: Path | None) -> list[str]:
    """Profile name of every client: round-robin over ``profiles``, then overrides from ``profile_map``."""
    names = [profiles[k % len(profiles)] if profiles else "" for k in range(num_clients)]
    if profile_map is not None:
        raw = read_regular_file(profile_map, max_bytes=MAX_CONFIG_BYTES, what="profile map")
        try:
            data = load_toml(raw.decode("utf-8"), f"profile map {profile_map}", max_bytes=MAX_CONFIG_BYTES)
        except UnicodeDecodeError as err:
            raise ConfigError(f"profile map {profile_map} must be UTF-8 TOML ({err.reason})") from None
        unknown = sorted(set(data) - {"default", "clients"})
        if unknown:
            raise ConfigError(
                f"profile map {profile_map}: unknown keys {unknown}; expected 'default' and [clients]"
            )
        if "default" in data:
            names = [str(data["default"])] * num_clients
        for key, name in dict(data.get("clients", {})).items():
            if not str(key).isdigit() or not 0 <= int(key) < num_clients:
                raise ConfigError(
                    f"profile map {profile_map}: client key {key!r} must be an index in [0, {num_clients})"
                )
            names[int(key)] = str(name)
    missing = [k for k, n in enumerate(names) if not n]
    if missing:
        raise ConfigError(f"clients {missing} have no profile; add a 'default' to the profile map")
    for name in sorted(set(names)):
        load_profile(name)  # validates early: a bad name fails before any training
    return names


def _client_config(
    config: SimulateConfig, k: int, role: str, init: Path | None, device: str | None = None
) -> ClientConfig:
    """Client ``k``'s settings: the simulation's search and CVAE, seed ``seed + k``, its resolved
    ``role``, ``device`` (None: ``config.device``) and, when it trains a classifier, the shared initial
    weights ``init`` (if any) and FedOV's unknown output when asked for (a CVAE-only device trains no
    classifier to give one)."""
    return ClientConfig(
        search=config.search,
        cvae=config.cvae,
        unknown_output=config.unknown_output and role != "cvae",
        precision=config.precision,
        val_fraction=config.val_fraction,
        seed=config.seed + k,
        device=config.device if device is None else device,
        progress=config.progress and config.jobs == 1,
        role=role,
        init=str(init) if init is not None and role != "cvae" else None,
    )


@dataclass(frozen=True)
class ClientPlan:
    """What every client of a federation runs: its profile name, its settings (seed ``seed + k``, its
    resolved role, the shared initial weights when it trains a classifier) and the initial-weights file
    (None when there is none). :func:`simulate` and the Flower ServerApp send the same plan."""

    profiles: tuple[str, ...]
    configs: tuple[ClientConfig, ...]
    init: Path | None


def plan_clients(
    config: SimulateConfig, task: ArrayDataset, *, device: torch.device | None = None
) -> ClientPlan:
    """The plan of ``config``'s federation on ``task`` (a data set of the task: its shape and classes);
    writes ``out_dir/init.onnx`` when the clients share initial weights (:func:`_shared_init`).
    ``device``: the clients' device resolved where they run (this machine, in :func:`simulate`); None
    leaves ``config.device`` for each client to resolve on its own (a Flower server plans for clients
    elsewhere)."""
    names = assign_profiles(config.num_clients, config.profiles, config.profile_map)
    roles = _roles(config, names, task)
    init = _shared_init(config, roles, task)
    where = None if device is None else str(device)
    configs = tuple(_client_config(config, k, roles[k], init, where) for k in range(config.num_clients))
    return ClientPlan(tuple(names), configs, init)


def _roles(config: SimulateConfig, names: list[str], task: ArrayDataset) -> list[str]:
    """Each client's role as `edge-sdk run --role auto` resolves it on its profile (classifier, cvae or
    both), with ``both`` made ``classifier`` when ``config.decoders`` is off."""

    roles = []
    for name in names:
        role = resolve_role(
            "auto", load_profile(name), task.input_shape, task.num_classes, config.search, config.cvae
        )
        roles.append("classifier" if role == "both" and not config.decoders else role)
    return roles


def _shared_init(config: SimulateConfig, roles: list[str], task: ArrayDataset) -> Path | None:
    """``out_dir/init.onnx``, the server's initial weights of the one architecture every classifier client
    trains (strategy ``fixed``), or None (``shared_init`` off, a search, or no classifier client).
    Written on every run: its bytes are a function of the arch, the task and the seed, so a resume finds
    the file its clients recorded (ClientConfig.to_dict holds its sha256)."""

    if not config.shared_init or not isinstance(config.search, FixedConfig) or set(roles) <= {"cvae"}:
        return None
    path = config.out_dir / "init.onnx"
    arch = config.search.for_input(task.input_shape).fixed_arch
    return write_initial_weights(path, arch, task.input_shape, task.num_classes, seed=config.seed)


def _run_one(data_path: str, bundle_path: str, profile_name: str, config: ClientConfig) -> dict[str, Any]:
    """One client, exactly as `edge-sdk run` would do it (runs in a worker process when jobs > 1)."""

    result = run_client(
        load_client_data(data_path), profile=load_profile(profile_name), config=config, out=bundle_path
    )
    return {"seconds": result.seconds}


def _client_line(bundle_path: Path, how: str) -> str:
    """The progress line of the client of ``bundle_path`` (named as its files are), from the report it
    wrote last: profile, role, arch, seconds and its local validation score (the test accuracy comes
    after the server, in ``results.json``)."""
    report = json.loads(bundle_path.with_name(bundle_path.name + ".report.json").read_text(encoding="utf-8"))
    metrics = report.get("metrics") or {}
    if "val_accuracy" in metrics:
        score = f"val accuracy {metrics['val_accuracy']:.4f}"
    else:  # a CVAE client: its decoder has no accuracy
        score = f"val loss {metrics.get('val_loss', float('nan')):.4f}"
    seconds = sum(report.get("seconds", {}).values())
    where = f"{report.get('profile')}, {report.get('role')}, {report.get('arch')}"
    return f"{bundle_path.name.removesuffix('.bundle')} ({where}): {how}, {seconds:.1f} s, {score}"


def _resume_key(client_config: ClientConfig, data_path: Path, profile_name: str) -> dict[str, Any]:
    """The resume key the client of ``data_path`` would record now, as its report stores it (JSON)."""
    data, profile = load_client_data(data_path), load_profile(profile_name)
    return json.loads(to_json(resume_key(client_config, data, profile)))


def _client_sizes(data_dir: Path, num_clients: int) -> list[int]:
    """Examples per client from the partition manifest (all equal when it does not say)."""
    try:
        sizes = json.loads((data_dir / "partition.json").read_text(encoding="utf-8"))["sizes"]
        if len(sizes) == num_clients and all(isinstance(v, int) for v in sizes):
            return list(sizes)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return [0] * num_clients


def _planned_flops(
    sizes: list[int], names: list[str], configs: list[ClientConfig], task: ArrayDataset
) -> list[int]:
    """Each client's planned device FLOPs (:func:`edge_sdk.client.plan_run`): what orders the clients'
    jobs. A size the manifest does not give (0) plans 0; that client's own run says what is wrong."""
    return [
        0
        if n < 2
        else plan_run(
            config, load_profile(name), n=n, input_shape=task.input_shape, num_classes=task.num_classes
        )[2]["total"]
        for n, name, config in zip(sizes, names, configs, strict=True)
    ]


def _partition_verdict(config: SimulateConfig, data_dir: Path) -> Verdict:
    """Whether ``data_dir`` holds this config's partition
    (:func:`server_kit.federation.resume.partition_verdict`)."""
    names = [f"{name}.npz" for name in _client_names(config.num_clients)] + ["test.npz"]
    return partition_verdict(data_dir, _partition_settings(config), names, config.resume)


def _partition_settings(config: SimulateConfig) -> dict[str, Any]:
    settings = partition_settings(
        config.dataset,
        num_clients=config.num_clients,
        alpha=config.alpha,
        seed=config.seed,
        min_size=config.min_size,
        data_root=config.data_root,
        image_size=config.image_size,
    )
    return json.loads(to_json(settings))


def _client_names(num_clients: int) -> list[str]:
    return [client_name(k, num_clients) for k in range(num_clients)]


def _partition(config: SimulateConfig, data_dir: Path) -> None:
    """Partition the dataset into ``data_dir`` (runs in a worker process when jobs > 1)."""
    partition(
        config.dataset,
        config.data_root,
        num_clients=config.num_clients,
        alpha=config.alpha,
        seed=config.seed,
        out_dir=data_dir,
        min_size=config.min_size,
        image_size=config.image_size,
    )


def _server_key(config: SimulateConfig, uploads: list[Path]) -> dict[str, Any]:
    """What the server's reusable work, the inversion chunks in ``server/synthetic/``, is a function of: the
    inversion settings, the server's seed, precision and device, the uploads' bytes and the code. A superset
    of what the inversion's own record checks (it refuses a directory of another run rather than redoing
    it), so a rerun with other clients or inversion settings redoes the chunks instead of stopping there."""
    aggregate_config = config.aggregate
    key = {
        "inversion": aggregate_config.inversion.to_dict(),
        "seed": aggregate_config.seed,
        "precision": aggregate_config.precision,
        "device": aggregate_config.device,
        "uploads": {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in uploads},
        "version": CODE_VERSION,
    }
    return json.loads(to_json(key))


@dataclass(frozen=True)
class SimulateResult:
    """What :func:`simulate` measured, as written to ``out_dir/results.json`` (:meth:`to_dict`).

    ``clients`` holds one row per client (its profile, kind, arch, sizes and seconds; a classifier's
    val and test accuracy, a CVAE client's val loss); ``seconds`` is per phase in the order they ran.
    """

    config: SimulateConfig
    seed: int
    clients: tuple[dict[str, Any], ...]
    global_accuracy: float | None
    mean_client_test_accuracy: float | None  # over the classifier clients; None when there are none
    synthetic_size: int
    resumed_clients: int  # clients whose finished bundles were reused (the rest ran)
    seconds: dict[str, float]
    started_at: float  # time.time() at the start (benchmarks/speed.py lines the phases up with it)
    server_report: Path  # the aggregation's report, relative to ``config.out_dir``
    # the clients that ran, with why their earlier files were not reused ({"client": k, "reason": ...})
    redone_clients: tuple[dict[str, Any], ...] = ()
    # the classifier uploads' own vote on the test images (server_kit.labelling.teacher_ceilings), the
    # global model's per-class accuracy and its retention (global over the label-weighted ceiling); None
    # where no classifier was uploaded
    teachers: dict[str, Any] | None = None

    @property
    def phase_order(self) -> list[str]:
        """The phases in the order they ran (``results.json`` writes its keys sorted)."""
        return list(self.seconds)

    def to_dict(self) -> dict[str, Any]:
        """The content of ``results.json``."""
        return {
            "config": self.config.to_dict(),
            "seed": self.seed,
            "clients": list(self.clients),
            "global_accuracy": self.global_accuracy,
            "mean_client_test_accuracy": self.mean_client_test_accuracy,
            "synthetic_size": self.synthetic_size,
            "resumed_clients": self.resumed_clients,
            "seconds": dict(self.seconds),
            "started_at": self.started_at,
            "phase_order": self.phase_order,
            "server_report": str(self.server_report),
            "redone_clients": list(self.redone_clients),
            "teachers": self.teachers,
        }


def simulate(
    config: SimulateConfig,
    *,
    device: torch.device | None = None,
    server_device: torch.device | None = None,
) -> SimulateResult:
    """Run the federation, write ``out_dir/results.json`` and return what it holds.

    ``device`` and ``server_device``: the clients' and the server's devices as the caller resolved them
    (the CLI, which checks them before any work); None resolves ``config.device`` and
    ``config.aggregate.device`` here. Either way each is resolved once and passed on."""

    out = config.out_dir
    assign_profiles(config.num_clients, config.profiles, config.profile_map)  # a bad name fails first
    for name in ("data", "clients", "server", "personal"):  # a link there would take the files elsewhere
        check_real_dir(out / name)
    # a missing GPU too, before the partition
    client_device = resolve_device(config.device) if device is None else device
    server_device = resolve_device(config.aggregate.device) if server_device is None else server_device
    seconds: dict[str, float] = {}
    started_at = time.time()  # phases follow in the order of ``seconds`` (benchmarks/speed.py)
    wall = time.perf_counter()

    with contextlib.ExitStack() as stack:
        # jobs > 1: the partition and every client run in worker processes forked from a fork server
        # (see server_kit.federation.workers), so this process never holds the dataset or a client's
        # training garbage
        pool = stack.enter_context(worker_pool(config.jobs)) if config.jobs > 1 else None
        with timed(seconds, "partition"):
            _ensure_partition(config, out / "data", pool)
        t0 = time.perf_counter()  # not `timed`: the phase ends after the worker pool has shut down, below
        clients_run = _run_clients(config, out, pool, client_device)
    seconds["clients"] = time.perf_counter() - t0
    bundles, names, verdicts, todo = clients_run

    # --- server ------------------------------------------------------------------------------------------
    test = load_client_data(out / "data" / "test.npz")
    uploads = [path for bundle in bundles for path in uploads_of(bundle)]
    prepare_server(out / "server", _server_key(config, uploads), config.resume)
    agg = aggregate(
        uploads,
        out / "server",
        config=config.aggregate,
        eval_data=test,
        progress=config.progress,
        device=server_device,
    )
    for phase, value in agg.seconds.items():
        seconds[f"server_{phase}"] = value

    # --- per-client metrics (local val accuracy; accuracy of its own model on the global test set) -----
    with timed(seconds, "evaluate_clients"):
        eval_threads = usable_threads()
        clients = [_client_row(k, path, names[k], test, eval_threads) for k, path in enumerate(bundles)]
        teachers = _teachers_row(uploads, test, agg.report)
    seconds["total"] = time.perf_counter() - wall

    scored = [c["test_accuracy"] for c in clients if "test_accuracy" in c]
    mean_client = sum(scored) / len(scored) if scored else None
    result = SimulateResult(
        config=config,
        seed=config.seed,
        clients=tuple(clients),
        global_accuracy=agg.accuracy,
        mean_client_test_accuracy=mean_client,
        synthetic_size=agg.synthetic_size,
        resumed_clients=config.num_clients - len(todo),
        seconds={k: round(v, 3) for k, v in seconds.items()},
        started_at=started_at,
        server_report=agg.report_path.relative_to(out),
        redone_clients=tuple({"client": k, "reason": verdicts[k].reason} for k in sorted(todo)),
        teachers=teachers,
    )
    atomic_write_json(out / "results.json", result.to_dict())
    write_report(out)  # from the files just written (results.json first: a failed drawing loses nothing)
    return result


def _ensure_partition(config: SimulateConfig, data_dir: Path, pool: Any) -> None:
    """The partition in ``data_dir``: reused when made with the same settings, else made (in a worker
    when there is a pool); ``resume="strict"`` refuses one made with other settings."""
    verdict = _partition_verdict(config, data_dir)
    if verdict.reuse:
        log.info("partition reused: %s has the same settings", data_dir)
    elif config.resume == "strict" and verdict.differs:
        refuse(data_dir / "partition.json", verdict)
    else:
        log.info("partition runs: %s", verdict.reason)
        if pool is None:
            _partition(config, data_dir)
            release_memory()  # the whole dataset was in this process; the clients read only their files
        else:
            pool.submit(_partition, config, data_dir).result()
            if "source" in _partition_settings(config):  # the worker's own log lines are not shown
                log.info("the images a worker decoded are cached in %s", cache_dir())


def _run_clients(
    config: SimulateConfig, out: Path, pool: Any, device: torch.device
) -> tuple[list[Path], list[str], list[Verdict], list[int]]:
    """Every client (each one a device, training on ``device``) that has no reusable bundle, so a killed
    run resumes: (bundles, profile names, verdicts, the clients that ran)."""
    names_on_disk = _client_names(config.num_clients)
    data_paths = [out / "data" / f"{name}.npz" for name in names_on_disk]
    client_dir = out / "clients"
    make_real_dir(client_dir)
    bundles = [client_dir / f"{name}.bundle" for name in names_on_disk]
    task = load_client_data(out / "data" / "test.npz")
    plan = plan_clients(config, task, device=device)
    names, client_configs = list(plan.profiles), list(plan.configs)
    verdicts = [
        Verdict(False, "--resume off")
        if config.resume == "off"
        else client_verdict(bundles[k], _resume_key(client_configs[k], data_paths[k], names[k]))
        for k in range(config.num_clients)
    ]
    if config.resume == "strict":
        for k, verdict in enumerate(verdicts):
            if verdict.differs:
                refuse(bundles[k], verdict)
    for k, verdict in enumerate(verdicts):  # why each client runs; a reused one says so as it is listed
        if not verdict.reuse:
            log.info("%s runs: %s", names_on_disk[k], verdict.reason)
    todo = [k for k in range(config.num_clients) if not verdicts[k].reuse]
    # the largest device plans first (longest-processing-time order): the last job to start is a short
    # one, so the workers finish close together instead of one waiting on a big client started last
    work = _planned_flops(_client_sizes(out / "data", config.num_clients), names, client_configs, task)
    todo.sort(key=lambda k: (-work[k], k))
    jobs = [(str(data_paths[k]), str(bundles[k]), names[k], client_configs[k]) for k in todo]
    _train_clients(config, pool, bundles, todo, jobs)
    return bundles, names, verdicts, todo


def _train_clients(
    config: SimulateConfig, pool: Any, bundles: list[Path], todo: list[int], jobs: list[tuple]
) -> None:
    """Run the clients' jobs: one log line per client as it finishes, and a bar over the clients where
    the clients' own bars are off (jobs > 1: nothing else would show before the server starts)."""
    bar = tqdm(
        total=config.num_clients,
        initial=config.num_clients - len(todo),
        desc="clients",
        unit="client",
        disable=not config.progress or pool is None,
    )
    with bar, logging_redirect_tqdm([logger]):
        for k in sorted(set(range(config.num_clients)) - set(todo)):
            logger.info("%s", _client_line(bundles[k], "reused"))
        if pool is None:
            for k, job in zip(todo, jobs, strict=True):
                _run_one(*job)
                logger.info("%s", _client_line(bundles[k], "trained"))
        else:
            futures = {pool.submit(_run_one, *job): k for k, job in zip(todo, jobs, strict=True)}
            for future in cf.as_completed(futures):
                future.result()  # re-raise the first client failure
                logger.info("%s", _client_line(bundles[futures[future]], "trained"))
                bar.update()


def _teachers_row(
    uploads: list[Path], test: ArrayDataset, server_report: dict[str, Any]
) -> dict[str, Any] | None:
    """The classifier uploads' ceilings on the test set, beside the global model's accuracy overall and
    per class and its retention (global over label-weighted): whether the devices or the server lost a
    class. Every classifier upload that loads counts, as the ceilings of the benchmarks count them."""
    classifiers, _ = split_kinds(without_clones(read_uploads(uploads), on_error="skip", skipped=[]))
    teachers = teachers_from_bundles(classifiers, skipped=[])
    if not teachers:
        return None
    fed = Federation.from_teachers(teachers, torch.device("cpu"), [])
    ceilings = teacher_ceilings(fed, to_float(test.x), test.y)
    accuracy, per_class = server_report.get("accuracy"), server_report.get("per_class_accuracy")
    weighted = float(ceilings["label_weighted"])  # type: ignore[arg-type]
    return ceilings | {
        "global": accuracy,
        "global_per_class": per_class,
        "retention": round(accuracy / weighted, 4) if accuracy is not None and weighted > 0 else None,
    }


def _client_row(k: int, path: Path, profile: str, test: ArrayDataset, threads: int) -> dict[str, Any]:
    """A client as ``results.json`` lists it: its bundle's metrics and, for a classifier, the accuracy of
    its own model on the global test set."""
    bundle = read_bundle(path)
    report = json.loads(path.with_name(path.name + ".report.json").read_text(encoding="utf-8"))
    m = bundle.metrics
    row: dict[str, Any] = {
        "client": k,
        "profile": profile,
        "kind": bundle.kind,
        "arch": bundle.arch,
        "num_examples": bundle.num_examples,
        "label_counts": list(bundle.label_counts),
        "seconds": report["seconds"],
    }
    if bundle.kind == "classifier":
        return row | {
            "val_accuracy": m["val_accuracy"],
            "test_accuracy": evaluate_onnx(
                bundle.model_onnx, test, unknown_output=bundle.unknown_output, threads=threads
            )["accuracy"],
            "flops": m["flops"],
            "params": m["params"],
            "candidate_epochs": m["candidate_epochs"],
        }
    return row | {  # a CVAE client (FedMHO): its decoder has no accuracy of its own
        "val_loss": m.get("val_loss"),
        "flops": m.get("decoder_flops"),
        "params": m.get("decoder_params"),
        "candidate_epochs": 0,
    }
