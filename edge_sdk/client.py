"""The device pipeline: split -> search -> train -> export -> bundle.

Each stage is its own public function so a device (or the CLI) can run them separately: the role
(:mod:`edge_sdk.roles`), the search (:mod:`edge_sdk.search`), the final training
(:mod:`edge_sdk.final_training`) and the files it writes (:mod:`edge_sdk.artifacts`). `run_client` chains
them exactly as `edge-sdk run` and `server-kit simulate` do, so a simulated client is a real one.

Roles (FedMHO): a ``classifier`` client searches, trains and uploads a classifier; a ``cvae`` client trains a
conditional VAE (:mod:`edge_sdk.cvae`) and uploads only its decoder as a ``cvae_decoder`` bundle. ``both``
(ours, not the paper's) runs the two in turn: the classifier bundle at ``out`` and the decoder bundle at
:func:`edge_sdk.artifacts.decoder_bundle_path` (``out`` with the suffix ``.decoder.bundle``). ``auto`` (the
default) follows the profile's role hint, picks ``cvae`` when the budget cannot fit the smallest classifier
the configured search could return (:func:`edge_sdk.roles.smallest_classifier`), since the search would then
fail anyway, and otherwise ``both`` when the CVAE fits the budget too: decoder samples carry the class they
were made for, which is what lets the server learn a class that few clients hold (benchmarks/RESULTS.md,
"Label skew"), for a CVAE that trains in seconds. ``classifier`` uploads the classifier only.

The report beside the bundle records the run's :func:`resume_key` (the settings of the role, the content
hash of the data, the device's budgets, the code version): `server-kit simulate` reuses a finished client
only when all of it matches what it would run now.

Time budget: the classifier's search and final training share one :class:`common.timing.Deadline`,
``time_budget_s`` seconds (the config's override, else the profile's) from the start of the run. The
final training is reserved ``FINAL_TRAINING_SHARE`` of it first: the most the search's screen lets any
candidate's estimated final training take (:func:`edge_sdk.profiling.trains_in_time`, at the profile's
GFLOP/s), so the search gets the rest and stops starting candidates when that is spent; the final
training gets whatever the search left and stops after the epoch during which the budget ran out (a
finalist not yet started is skipped). The report's ``budget`` and the bundle's metrics say whether and
where the budget cut the work; the search's ``progress`` says how much of its plan ran. The CVAE is not
cut.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.checks import check_int, is_number
from common.device import check_device, resolve_device
from common.errors import BudgetError, ConfigError
from common.seeding import derive_seed
from common.timing import Clock, Deadline, timed
from edge_sdk import __version__
from edge_sdk.artifacts import TrainedModel, bundle_cvae, bundle_model, decoder_bundle_path
from edge_sdk.curves import curve_records
from edge_sdk.cvae import CVAEConfig
from edge_sdk.data import ArrayDataset, data_sha256, split_sizes, split_train_val
from edge_sdk.final_training import train_cvae_final, train_final
from edge_sdk.halving import COSTS, halving_rungs, rank_finalists
from edge_sdk.models.arch import family_of_text, parse_arch, with_num_classes
from edge_sdk.models.elastic.network import ELASTIC_FAMILY
from edge_sdk.models.elastic.spec import ElasticSpec
from edge_sdk.models.elastic.supernet import extract
from edge_sdk.models.elastic.supernet_file import load_supernet
from edge_sdk.plan import actual_flops, affordable_final_epochs, compare, plan_flops, plan_line
from edge_sdk.precision import Precision, check_precision, resolve_precision
from edge_sdk.profiling import FINAL_TRAINING_SHARE, fits, profile_model, trains_in_time
from edge_sdk.roles import CLIENT_ROLES, ClientRole, resolve_role
from edge_sdk.search import SearchResult, search
from edge_sdk.shared_init import read_initial_weights
from edge_sdk.strategies.base import SearchConfig
from edge_sdk.strategies.baselines import FixedConfig
from edge_sdk.strategies.evolution import supernet_of
from edge_sdk.strategies.pso import PSOConfig
from edge_sdk.train import release_memory
from export.atomic import atomic_write_json
from profiles import DeviceProfile

__all__ = [
    "CODE_VERSION",
    "PROFILE_KEY_FIELDS",
    "ClientConfig",
    "ClientResult",
    "finalist_seed",
    "plan_run",
    "resume_key",
    "run_client",
]


log = logging.getLogger(__name__)  # the plan line, through edge_sdk's handler (common.cli)
FINALIST_STREAM = 3  # derive_seed stream of the chosen finalist's remaining epochs
# a finalist's row in the report: what the halving ranks it by (edge_sdk.halving.rank_finalists) and its cost
FINALIST_FIELDS = ("val_accuracy", "val_loss", "train_seconds", *COSTS)
# The code that made a client's files: the toolkit's version, plus the client pipeline's own number, bumped
# when a change makes the same settings and data give another bundle (new training, export or metrics),
# so a resume redoes the clients of older code even between releases
# 2: the time budget stops the search and final training; 3: successive halving in rungs, plateau stop;
# 4: the color training recipe (augmentation, weight decay, cosine schedule) and the chain's residual block;
# 5: the finalists' rule keeps the search's warm start on a tie; 6: a finalist must have beaten the warm
# start in the search; 7: validation at common.torch_utils.INFER_BATCH (its losses sum in another order);
# 8: the finalists' rule counts training memory as a cost, and Adam's update is fused (other rounding)
CODE_VERSION = f"{__version__}+client.8"


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Everything a device run needs besides its data and profile.

    ``role`` is one of :data:`CLIENT_ROLES` (see the module docstring); ``cvae`` configures the CVAE of
    the ``cvae`` and ``both`` roles.
    """

    search: SearchConfig = field(default_factory=PSOConfig)
    val_fraction: float = 0.2  # share of the data held out for local validation
    seed: int = 0  # seed of the split, the search and the training
    device: str = "auto"  # where the device trains: auto (CUDA when present), cpu, cuda or cuda:N
    progress: bool = False
    # what the device trains: a classifier, a CVAE (its decoder is uploaded), both, or auto: what the
    # profile's role hint and its budget allow
    role: ClientRole = "auto"
    cvae: CVAEConfig = field(default_factory=CVAEConfig)
    # the classifier gets an extra "unknown" output trained on corrupted local images (FedOV), so the
    # server can weigh it by how sure it is that a sample is one of its classes
    unknown_output: bool = False
    # auto, fp32 or bf16: the search's candidates and the final training run their forward passes in
    # bfloat16 where the hardware has it (auto) or as given; reported accuracies are measured in float32
    precision: Precision = "auto"
    # the server's shared initial weights (from server-kit init): the classifier trains their
    # architecture from them instead of searching one, so the uploads can be averaged (FedAvg)
    init: str | None = None
    # seconds the device may spend on the classifier's search and final training, over the profile's
    # time_budget_s (None: the profile's); the search's screen holds candidates to it too
    time_budget_s: float | None = None

    def __post_init__(self) -> None:
        check_precision(self.precision)
        if self.time_budget_s is not None:
            if not (is_number(self.time_budget_s) and self.time_budget_s > 0):  # type: ignore[operator]
                raise ConfigError(
                    f"time_budget_s must be a finite number of seconds > 0, got {self.time_budget_s!r}; "
                    "fix: a positive budget, or None for the profile's time_budget_s"
                )
            if self.role == "cvae":
                raise ConfigError(
                    "time_budget_s bounds the classifier's search and final training; role 'cvae' trains "
                    "no classifier: drop time_budget_s or choose another role"
                )
        if not isinstance(self.search, SearchConfig):
            raise ConfigError(f"search must be a strategy's SearchConfig, got {type(self.search).__name__}")
        if self.init is not None:
            if not isinstance(self.init, str) or not self.init:
                raise ConfigError(
                    f"init must be the path of an initial-weights file or None, got {self.init!r}"
                )
            if self.role == "cvae":
                raise ConfigError("init holds classifier weights; role 'cvae' trains no classifier")
            if self.search.strategy != "fixed":
                raise ConfigError(
                    f"initial weights fix the architecture, the search strategy is {self.search.strategy!r}; "
                    "fix: strategy 'fixed' with fixed_arch the file's arch (edge-sdk run --init sets both)"
                )
            if self.unknown_output:
                raise ConfigError("initial weights have no 'unknown' output: drop unknown_output or init")
        check_int("seed", self.seed, 0, 2**64 - 1)  # a bundle records it: what a bundle can hold
        if not is_number(self.val_fraction) or not 0.0 < self.val_fraction < 1.0:  # type: ignore[operator]
            raise ConfigError(f"val_fraction must be in (0, 1), a number, got {self.val_fraction!r}")
        if not isinstance(self.progress, bool):
            raise ConfigError(f"progress must be a bool, got {self.progress!r}")
        check_device(self.device)
        if self.role not in CLIENT_ROLES:
            raise ConfigError(f"role must be one of {CLIENT_ROLES}, got {self.role!r}")
        if not isinstance(self.cvae, CVAEConfig):
            raise ConfigError(f"cvae must be a CVAEConfig, got {type(self.cvae).__name__}")
        if not isinstance(self.unknown_output, bool):
            raise ConfigError(f"unknown_output must be a bool, got {self.unknown_output!r}")
        if self.unknown_output and self.role == "cvae":
            raise ConfigError("unknown_output is a classifier option; role 'cvae' trains no classifier")
        if self.unknown_output and supernet_of(self.search) is not None:
            raise ConfigError(
                "unknown_output needs a classifier trained from scratch; a supernet subnet starts from "
                "weights with num_classes outputs: drop --supernet or --unknown-output"
            )

    def for_input(self, input_shape: tuple[int, int, int]) -> ClientConfig:
        """This config with its search's input-dependent settings resolved for images of
        ``input_shape`` (:meth:`edge_sdk.strategies.base.SearchConfig.for_input`)."""
        return dataclasses.replace(self, search=self.search.for_input(input_shape))

    def for_device(
        self, profile: DeviceProfile, *, n: int, input_shape: tuple[int, int, int], num_classes: int
    ) -> ClientConfig:
        """:meth:`for_input`, then final epochs left to the recipe cut to what the device's budget pays
        for (:func:`edge_sdk.plan.affordable_final_epochs`, ``profile`` under this config's
        ``time_budget_s``): a slow device trains fewer epochs than the recipe's most instead of having
        every candidate refused. Where the config meets a device and its data, this resolves it."""
        resolved = self.for_input(input_shape)
        if self.search.final_epochs is not None:  # given: trained as asked (the screen holds it to time)
            return resolved
        epochs = affordable_final_epochs(
            resolved.search,
            budgeted_profile(self, profile),
            n_train=split_sizes(n, self.val_fraction)[0],
            input_shape=input_shape,
            num_classes=num_classes,
        )
        return dataclasses.replace(resolved, search=dataclasses.replace(resolved.search, final_epochs=epochs))

    def to_dict(self) -> dict[str, Any]:
        """The settings a client report records (and a resume compares): those that apply to the role
        (an explicit ``classifier`` trains no CVAE, ``cvae`` searches nothing, so the other half's
        settings are left out; ``auto`` and ``both`` keep both). ``unknown_output`` is written only when
        set, so the reports of clients made before it existed still match, as is ``time_budget_s``;
        ``precision`` is written resolved."""
        out: dict[str, Any] = {
            "search": self.search.to_dict(),
            "val_fraction": self.val_fraction,
            "seed": self.seed,
            "device": self.device,
            "role": self.role,
            "cvae": self.cvae.to_dict(),
        }
        if self.role == "classifier":
            del out["cvae"]
        elif self.role == "cvae":
            del out["search"]
        # the precision that runs (auto resolved on this machine), so a resume on a machine where auto
        # means another precision trains again
        precision = resolve_precision(self.precision, resolve_device(self.device))
        if self.init is not None:
            # the file's content, not its path: a resume after a new init trains again, a run directory
            # moved elsewhere does not (the report's "init" entry says where the file was)
            out["init"] = {"sha256": _file_sha256(self.init)}
        if self.time_budget_s is not None:  # a result made under another budget is another run's
            out["time_budget_s"] = float(self.time_budget_s)
        return out | ({"unknown_output": True} if self.unknown_output else {}) | {"precision": precision}


# the fields of a device profile its client's files depend on (the budgets and the role hint; the
# description, where gflops was measured and the core count are informational)
PROFILE_KEY_FIELDS = ("name", "memory_mb", "gflops", "max_flops", "max_params", "role", "time_budget_s")


def budgeted_profile(config: ClientConfig, profile: DeviceProfile) -> DeviceProfile:
    """``profile`` with the config's ``time_budget_s`` where it overrides the profile's."""
    if config.time_budget_s is None:
        return profile
    return dataclasses.replace(profile, time_budget_s=float(config.time_budget_s))


def resume_key(config: ClientConfig, data: ArrayDataset, profile: DeviceProfile) -> dict[str, Any]:
    """What a client's files are a function of, as its report records it: ``config`` (the settings of
    the role, :meth:`ClientConfig.to_dict`), ``data_sha256`` (the content of the data it trained on,
    :func:`edge_sdk.data.data_sha256`), ``device_profile`` (the budgets it searched under) and
    ``version`` (:data:`CODE_VERSION`). A resume compares the recorded key with the one of the run it
    would do; any difference means the files are another run's. The config is recorded resolved for the
    data and the device (:meth:`ClientConfig.for_device`): what ran, not what was left to them."""
    budget = {name: getattr(profile, name) for name in PROFILE_KEY_FIELDS}
    resolved = config.for_device(
        profile, n=len(data), input_shape=data.input_shape, num_classes=data.num_classes
    )
    return {
        "config": resolved.to_dict(),
        "data_sha256": data_sha256(data),
        "device_profile": {name: budget[name] for name in PROFILE_KEY_FIELDS},
        "version": CODE_VERSION,
    }


def _file_sha256(path: str) -> str | None:
    """sha256 of a file's bytes, None when it cannot be read (the run then fails where it reads it)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


@dataclass(frozen=True)
class ClientResult:
    """What `run_client` wrote. ``bundle_path`` / ``arch`` / ``metrics`` describe the bundle at ``out``
    (the classifier for ``both``); ``search`` is None when no search ran (role ``cvae``);
    ``extra_bundles`` holds the decoder bundle of the ``both`` role."""

    bundle_path: Path
    report_path: Path
    arch: str
    search: SearchResult | None
    metrics: dict[str, Any]
    seconds: dict[str, float]
    role: str = "classifier"
    extra_bundles: tuple[Path, ...] = ()


def plan_run(
    config: ClientConfig,
    profile: DeviceProfile,
    *,
    n: int,
    input_shape: tuple[int, int, int],
    num_classes: int,
    hosted: bool = False,
) -> tuple[str, DeviceProfile, dict[str, Any]]:
    """What a client run on ``n`` examples will do, known before any work: its role, the profile its
    budgets screen under (``time_budget_s`` overridden) and its device plan
    (:func:`edge_sdk.plan.plan_flops`). :func:`run_client` logs and reports the plan; `simulate` starts
    the clients with the largest plans first."""
    n_train, n_val = split_sizes(n, config.val_fraction)  # too few examples: refused before anything else
    config = config.for_device(profile, n=n, input_shape=input_shape, num_classes=num_classes)
    budgeted = budgeted_profile(config, profile)
    role = resolve_role(
        config.role, profile, input_shape, num_classes, config.search, config.cvae, hosted=hosted
    )
    classifies, decodes = role in ("classifier", "both"), role in ("cvae", "both")
    plan = plan_flops(
        search=config.search if classifies else None,
        cvae=config.cvae if decodes else None,
        searched=config.init is None,
        profile=budgeted,
        n_train=n_train,
        n_val=n_val,
        input_shape=input_shape,
        num_classes=num_classes,
    )
    return role, budgeted, plan


def run_client(
    data: ArrayDataset,
    *,
    profile: DeviceProfile,
    config: ClientConfig,
    out: str | Path,
    clock: Clock = time.perf_counter,
    hosted: bool = False,
) -> ClientResult:
    """The device pipeline for the resolved role, as `edge-sdk run`. Writes `out` and `out`.report.json
    (and, for ``both``, the decoder bundle at :func:`decoder_bundle_path`). The time budget (module
    docstring) runs on ``clock`` (a test passes a fake one), as do the search's and training's
    ``seconds``. ``hosted``: this process is the profile's device, so the role must fit its memory too
    (:func:`edge_sdk.roles.resolve_role`)."""
    out = Path(out)
    resolve_device(config.device)  # a missing GPU is refused before any work
    config = config.for_device(
        profile, n=len(data), input_shape=data.input_shape, num_classes=data.num_classes
    )
    role, budgeted, plan = plan_run(
        config,
        profile,
        n=len(data),
        input_shape=data.input_shape,
        num_classes=data.num_classes,
        hosted=hosted,
    )
    deadline = Deadline.after(budgeted.time_budget_s, clock)
    train_split, val_split = split_train_val(data, val_fraction=config.val_fraction, seed=config.seed)
    report_path = out.with_name(out.name + ".report.json")
    seconds: dict[str, float] = {}
    report: dict[str, Any] = {"role": role, "profile": profile.name} | resume_key(config, data, profile)
    classifies, decodes = role in ("classifier", "both"), role in ("cvae", "both")
    sizes = {"n_train": len(train_split), "n_val": len(val_split)}
    log.info("%s", plan_line(plan, budgeted))
    result: ClientResult | None = None
    cvae_metrics: dict[str, Any] | None = None
    if classifies:
        result = _run_classifier(train_split, val_split, budgeted, config, out, seconds, report, deadline)
    if decodes:
        result, cvae_metrics = _run_decoder(
            train_split, val_split, profile, config, out, role, result, seconds, report
        )
    assert result is not None
    report["device_plan"] = _plan_kept(plan, config, result, report, cvae_metrics, seconds, sizes)
    report["seconds"] = {k: round(v, 3) for k, v in seconds.items()}
    atomic_write_json(report_path, dict(sorted(report.items())))
    release_memory()  # a simulation's worker goes on to the next client with what it freed given back
    return result


def _run_decoder(
    train_split: ArrayDataset,
    val_split: ArrayDataset,
    profile: DeviceProfile,
    config: ClientConfig,
    out: Path,
    role: str,
    result: ClientResult | None,
    seconds: dict[str, float],
    report: dict[str, Any],
) -> tuple[ClientResult, dict[str, Any]]:
    """Train and bundle the CVAE: the client's bundle for ``cvae``, beside the classifier's for ``both``."""
    path = out if role == "cvae" else decoder_bundle_path(out)
    report_path = out.with_name(out.name + ".report.json")
    with timed(seconds, "cvae_train"):
        trained = train_cvae_final(
            train_split,
            val_split,
            config=config.cvae,
            profile=profile,
            seed=config.seed,
            device=config.device,
            progress=config.progress,
        )
    with timed(seconds, "cvae_export"):
        bundle_cvae(trained, profile, path, seed=config.seed)
    entry = {"bundle": path.name, "arch": trained.arch, "metrics": trained.metrics}
    report["curves"] = report.get("curves", {}) | curve_records({"cvae": trained.history})
    if result is None:
        report |= entry | {"search": None}
        result = ClientResult(path, report_path, trained.arch, None, dict(trained.metrics), seconds, role)
    else:
        report["decoder"] = entry
        result = ClientResult(
            out, report_path, result.arch, result.search, result.metrics, seconds, role, (path,)
        )
    return result, dict(trained.metrics)


def _plan_kept(
    plan: dict[str, Any],
    config: ClientConfig,
    result: ClientResult,
    report: dict[str, Any],
    cvae_metrics: dict[str, Any] | None,
    seconds: dict[str, float],
    sizes: dict[str, int],
) -> dict[str, Any]:
    """The device plan against what the run spent: FLOPs counted from what ran, seconds measured."""
    subset = min(sizes["n_train"], config.search.max_train_samples or sizes["n_train"])
    spent = actual_flops(
        candidates=[(e.flops, e.epochs) for e in (result.search.evaluations if result.search else ())],
        finalists=report.get("finalists", []),
        search_subset=subset,
        val_every_epoch=config.search.plateau() is not None,
        cvae_flops=None if cvae_metrics is None else int(cvae_metrics["flops"]),
        cvae_epochs=config.cvae.epochs,
        **sizes,
    )
    measured = sum(seconds.get(phase, 0.0) for phase in ("search", "train", "cvae_train"))
    return compare(plan, spent, measured)


def finalist_seed(seed: int, rung: int | None) -> int:
    """The seed of one part of a finalist's training: rung ``rung`` of the halving (the first: the
    client's seed), or, for None, the kept finalist's remaining epochs."""
    if rung is None:
        return derive_seed(seed, FINALIST_STREAM)
    return seed if rung == 0 else derive_seed(seed, FINALIST_STREAM, rung)


def _train_finalists(
    result: SearchResult,
    train_split: ArrayDataset,
    val_split: ArrayDataset,
    config: ClientConfig,
    deadline: Deadline,
) -> tuple[TrainedModel, list[dict[str, Any]], bool]:
    """Successive halving over the search's finalists (:func:`edge_sdk.halving.halving_rungs`): all train
    the first rung's epochs, the best of them by :func:`~edge_sdk.halving.rank_finalists` (the
    one-standard-error rule; the search's warm start kept on a tie) go on to the next rung with their
    optimizers, until one is left; it trains on to ``final_epochs`` unless its validation curve flattens
    first (``SearchConfig.plateau``). Returns it, one row per finalist trained (validation numbers after
    its last rung; the chosen row adds the final ones) and whether ``deadline`` cut the training (a
    training stops after the epoch during which it passed; a finalist not started by then is skipped)."""
    search_config = config.search
    final_epochs = search_config.resolved_final_epochs()
    keep = float(getattr(search_config, "finalist_keep", 0.0))
    rungs = halving_rungs(len(result.finalists), search_config.finalist_epochs(), keep)
    run = functools.partial(_train_more, train_split, val_split, config)
    on_all = search_config.rests_on_all()  # the winner's last epochs see the validation images too
    every = train_split.concat(val_split) if on_all else train_split
    go_on = functools.partial(_train_more, every, val_split, config)
    models: dict[int, TrainedModel] = {}
    rows: dict[int, dict[str, Any]] = {}
    alive, cut = list(range(len(result.finalists))), False
    incumbent = result.finalists.index(result.incumbent) if result.incumbent in result.finalists else None
    for rung, (count, epochs) in enumerate(rungs):
        trained_now = []
        for i in alive[:count]:
            if models and deadline.expired():
                cut = True
                break
            seed = finalist_seed(config.seed, rung)
            models[i] = run(models.get(i), result.finalists[i], epochs, seed, deadline)
            m = models[i].metrics
            cut = cut or m["final_epochs"] < sum(e for _, e in rungs[: rung + 1])
            rows[i] = {k: m[k] for k in FINALIST_FIELDS} | {
                "arch": result.finalists[i], "epochs": m["final_epochs"], "rungs": rung + 1
            }  # fmt: skip
            trained_now.append(i)
        inc = trained_now.index(incumbent) if incumbent in trained_now else None
        ranked = rank_finalists([rows[i] for i in trained_now], len(val_split), inc)
        alive = [trained_now[j] for j in ranked]
        if cut:
            break
    chosen = alive[0] if rungs else 0
    best = models.get(chosen)
    if best is None and on_all and 0 < search_config.finalist_epochs() < final_epochs:
        # a lone finalist holds the validation images back for the share the halving would, so the
        # bundle's validation numbers are measured on images it did not train on
        best = run(None, result.finalists[chosen], search_config.finalist_epochs(), config.seed, deadline)
        cut = best.metrics["final_epochs"] < search_config.finalist_epochs()
    rest = final_epochs - (best.metrics["final_epochs"] if best else 0)
    plateau = search_config.plateau()
    done = best is not None and plateau is not None and plateau([h["val_loss"] for h in best.history])
    held = best
    if rest > 0 and best is not None and (cut or deadline.expired()):
        cut = True
    elif (rest > 0 or best is None) and not done:
        # the winner goes on where it stopped, Adam's moments kept (new batch orders), on every image
        # where the validation split has done its work (rest_on_all)
        seed = config.seed if best is None else finalist_seed(config.seed, None)
        best = (run if best is None else go_on)(best, result.finalists[chosen], rest, seed, deadline, plateau)
        m = best.metrics
        cut = m["final_epochs"] < final_epochs and not m["plateau_stopped"]
    assert best is not None
    seen = on_all and held is not None and best is not held  # its last epochs saw the validation images
    if seen:
        best = _held_out_numbers(best, held)
    if chosen not in rows:  # one finalist: no rung
        m = best.metrics
        rows[chosen] = {k: m[k] for k in FINALIST_FIELDS} | {
            "arch": best.arch, "epochs": m["final_epochs"], "rungs": 0
        }  # fmt: skip
    if seen:  # the epochs on every image, for the device plan's count of what the training spent
        on_every = best.metrics["final_epochs"] - best.metrics["val_epochs"]
        rows[chosen] |= {"final_epochs": best.metrics["final_epochs"], "epochs_on_all": on_every}
    elif chosen in models and best is not models[chosen]:
        rows[chosen] |= {
            "final_val_accuracy": best.metrics["val_accuracy"],
            "final_val_loss": best.metrics["val_loss"],
            "final_epochs": best.metrics["final_epochs"],
            "best_epoch": best.metrics["best_epoch"],
        }
    out = [rows[i] | {"chosen": i == chosen} for i in sorted(rows)]
    return best, out, cut


def _held_out_numbers(trained: TrainedModel, held: TrainedModel) -> TrainedModel:
    """``trained`` (its last epochs on the validation images too) with the validation numbers ``held``
    measured before they joined, and the epoch they were measured at (``val_epochs``)."""
    keep = {k: held.metrics[k] for k in ("val_accuracy", "val_loss")}
    extra = {"val_epochs": held.metrics["final_epochs"]}
    return dataclasses.replace(trained, metrics=trained.metrics | keep | extra)


def _train_more(
    train_split: ArrayDataset,
    val_split: ArrayDataset,
    config: ClientConfig,
    before: TrainedModel | None,
    arch: str,
    epochs: int,
    seed: int,
    deadline: Deadline,
    plateau: Callable[[Sequence[float]], bool] | None = None,
) -> TrainedModel:
    """``epochs`` more of ``arch``'s final training: from ``before`` (its module and optimizer, one
    history and count of epochs and seconds over both runs), else from scratch (or, for a supernet's
    subnet, from the supernet's weights: HAPFNAS fine-tunes it locally). The validation numbers are
    measured every epoch where the search config has a plateau rule; with ``plateau`` the weights of the
    lowest validation loss are returned (:func:`edge_sdk.final_training.train_final`)."""
    search_config = config.search
    init, optimizer = (before.module, before.optimizer) if before is not None else (None, None)
    done = before.metrics["final_epochs"] if before is not None else 0  # one schedule over all the parts
    final_epochs = search_config.resolved_final_epochs()
    supernet = supernet_of(search_config)
    if before is None and supernet is not None and family_of_text(arch) is ELASTIC_FAMILY:
        init = extract(load_supernet(supernet), ElasticSpec.parse(arch))
    trained = train_final(
        arch, train_split, val_split, epochs=epochs, lr=search_config.lr, batch_size=search_config.batch_size,
        seed=seed, device=config.device, progress=config.progress, init=init, optimizer=optimizer,
        unknown_output=config.unknown_output, precision=config.precision, stop=deadline.expired,
        track_val=search_config.plateau() is not None, plateau=plateau,
        prior_val=[h["val_loss"] for h in before.history] if before is not None and plateau else (),
        schedule_span=(done, max(done + epochs, final_epochs)), **search_config.recipe(),
    )  # fmt: skip
    if before is None:
        return trained
    m = trained.metrics
    return dataclasses.replace(
        trained,
        history=before.history + trained.history,  # one curve over all its epochs
        metrics=m
        | {
            "final_epochs": before.metrics["final_epochs"] + m["final_epochs"],
            # the plateau rule may return the weights ``before`` ended with (best_epoch 0 of this run)
            "best_epoch": before.metrics["final_epochs"] + m["best_epoch"],
            "train_loss": m["train_loss"] if m["best_epoch"] else before.metrics["train_loss"],
            "train_seconds": round(before.metrics["train_seconds"] + m["train_seconds"], 3),
        },
    )


def _train_from_init(
    train_split: ArrayDataset,
    val_split: ArrayDataset,
    profile: DeviceProfile,
    config: ClientConfig,
    report: dict[str, Any],
    deadline: Deadline,
) -> tuple[SearchResult, TrainedModel, list[dict[str, Any]]]:
    """The server's initial weights, checked against this task, the configured architecture and the
    device's budget (FLOPs, parameters, training memory, the final training's time), then trained for
    ``final_epochs`` (fewer when ``deadline`` passes first). Returns a search result of the ``fixed``
    strategy that evaluated nothing."""
    assert config.init is not None
    search_config = config.search
    assert isinstance(search_config, FixedConfig)  # ClientConfig refuses init with another strategy
    weights = read_initial_weights(
        config.init, input_shape=train_split.input_shape, num_classes=train_split.num_classes
    )
    wanted = with_num_classes(parse_arch(search_config.fixed_arch), train_split.num_classes)
    if weights.arch != str(wanted):
        raise ConfigError(
            f"initial weights {config.init} are for {weights.arch}, the configured architecture is {wanted}; "
            "fix: train the file's architecture (--fixed-arch) or ask the server for weights of yours"
        )
    cost = profile_model(weights.module, train_split.input_shape, batch_size=search_config.batch_size)
    problem = fits(cost, profile) or trains_in_time(
        cost.flops, len(train_split), search_config.resolved_final_epochs(), profile
    )
    if problem is not None:
        raise BudgetError(
            f"the initial weights' architecture {weights.arch} does not fit the device {profile.name!r}: "
            f"{problem}; fix: ask the server for a smaller architecture"
        )
    trained = train_final(
        weights.arch,
        train_split,
        val_split,
        epochs=search_config.resolved_final_epochs(),
        lr=search_config.lr,
        batch_size=search_config.batch_size,
        seed=config.seed,
        device=config.device,
        progress=config.progress,
        init=weights.module,
        precision=config.precision,
        stop=deadline.expired,
        **search_config.recipe(),
    )
    report["init"] = {"path": config.init, "sha256": weights.sha256, "seed": weights.seed}
    result = SearchResult(
        strategy="fixed",
        best_spec=weights.arch,
        best_fitness=math.nan,
        evaluations=(),
        candidate_epochs=0,
        rejected=0,
        cache_hits=0,
        seconds=0.0,
        repeats_best=((weights.arch, math.nan),),
        details={"init": weights.sha256},
    )
    m = trained.metrics
    row = {k: m[k] for k in FINALIST_FIELDS}
    return result, trained, [row | {"arch": weights.arch, "epochs": m["final_epochs"], "chosen": True}]


def _run_classifier(
    train_split: ArrayDataset,
    val_split: ArrayDataset,
    profile: DeviceProfile,
    config: ClientConfig,
    out: Path,
    seconds: dict[str, float],
    report: dict[str, Any],
    deadline: Deadline,
) -> ClientResult:
    """search -> train -> export -> bundle at ``out`` (or, with ``config.init``, train the server's
    initial weights, no search), within ``deadline`` (module docstring); fills ``seconds`` and
    ``report``."""
    search_share = (1 - FINAL_TRAINING_SHARE) * profile.time_budget_s
    train_cut = False
    if config.init is not None:
        with timed(seconds, "train", deadline.clock):
            result, trained, finalists = _train_from_init(
                train_split, val_split, profile, config, report, deadline
            )
        train_cut = trained.metrics["final_epochs"] < config.search.final_epochs
    else:
        with timed(seconds, "search", deadline.clock):
            result = search(
                train_split,
                val_split,
                profile=profile,
                config=config.search,
                seed=config.seed,
                device=resolve_device(config.device),
                progress=config.progress,
                precision=config.precision,
                deadline=deadline.within(search_share),
            )
        with timed(seconds, "train", deadline.clock):
            trained, finalists, train_cut = _train_finalists(result, train_split, val_split, config, deadline)
    stopped = ",".join(
        phase for phase, cut in (("search", result.budget_stopped), ("train", train_cut)) if cut
    )

    with timed(seconds, "export"):
        extra = {
            "strategy": result.strategy,
            "candidate_epochs": int(result.candidate_epochs),
            "finalists": len(finalists),
            "search_rejected": int(result.rejected),
            "search_cache_hits": int(result.cache_hits),
            "search_seconds": round(seconds.get("search", 0.0), 3),
            "time_budget_s": float(profile.time_budget_s),
            "budget_stopped": stopped or None,
        }
        bundle_model(trained, profile, out, seed=config.seed, extra_metrics=extra)

    metrics = dict(trained.metrics) | extra
    report |= {
        "bundle": out.name,
        "arch": trained.arch,
        "metrics": metrics,
        "search": result.to_dict(),
        "finalists": finalists,
        "budget": {
            "time_budget_s": float(profile.time_budget_s),
            "source": "profile" if config.time_budget_s is None else "config",
            "search_share_s": round(search_share, 3) if config.init is None else 0.0,
            "stopped": stopped or None,
            "final_epochs": [trained.metrics["final_epochs"], config.search.final_epochs],
            "finalists": [len(finalists), len(result.finalists)],
        },
        # the bundle's metrics are scalars: the per-epoch curves are the report's (edge_sdk.curves)
        "curves": curve_records({"classifier": trained.history, "search": result.best_curve}),
    }
    return ClientResult(
        bundle_path=out,
        report_path=out.with_name(out.name + ".report.json"),
        arch=trained.arch,
        search=result,
        metrics=metrics,
        seconds=seconds,
        role="classifier",
    )
