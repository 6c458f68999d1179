"""The options every search strategy shares, and the record a client report keeps of them."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from common.checks import check_int, check_number, from_preset, is_number
from common.errors import ConfigError, SpecError
from edge_sdk.augment import Augment, Schedule, check_recipe, resolve_recipe
from edge_sdk.halving import plateaued
from edge_sdk.models.arch import parse_arch

__all__ = [
    "AUGMENTED_FINAL_EPOCHS",
    "AUGMENTED_WARM_START",
    "PLAIN_FINAL_EPOCHS",
    "PLAIN_WARM_START",
    "PLATEAU_PATIENCE",
    "RECORD_DEFAULTS",
    "SHARED_PRESETS",
    "SearchConfig",
    "check_arch",
]

_Config = TypeVar("_Config", bound="SearchConfig")  # not typing.Self (3.11+): the source stays 3.10-clean

# What ``final_epochs`` and ``plateau_patience`` left as None become, from the recipe the input calls for
# (:meth:`SearchConfig.for_input`), at most: a device whose budget pays for fewer trains those
# (:meth:`edge_sdk.client.ClientConfig.for_device`). Augmented training sees every image in a new crop
# each epoch and keeps learning for many passes: on color pictures of a few thousand images the teachers'
# combined vote still gains from 20 to 40 epochs, past which the epochs cost more device time than they
# buy; a decaying learning rate brings the validation loss down at the schedule's end, so a curve that
# looks flat half-way at a high rate is no reason to stop, and the plateau rule is off under it. Plain
# training stops at 6: the teachers' combined vote is as good after 6 epochs as after 8, for a quarter less
# of the device time that dominates a federation.
PLAIN_FINAL_EPOCHS = 6
AUGMENTED_FINAL_EPOCHS = 40
PLATEAU_PATIENCE = 2
# The hand-made design a search starts from (``fixed_arch`` left None), from the input's recipe as the
# epochs are: pFedZKD's CNN1 for plain images (its two 5x5 convolutions, as every grayscale result was
# measured with); for pictures the recipe augments, the usual small CIFAR design, three stages of one 3x3
# convolution each with the width doubling after every pooling: three stages see objects at the sizes a
# camera picture holds them, at two thirds of CNN1's FLOPs at 32x32x3
PLAIN_WARM_START = "C32k5-P-C64k5-P-F10"
AUGMENTED_WARM_START = "C32k3-P-C64k3-P-C128k3-P-F10"

# The presets' values of the shared fields (``fast`` = the defaults; ``paper`` = pFedZKD section 4.1.2).
SHARED_PRESETS: dict[str, dict[str, Any]] = {
    "fast": {},
    "paper": {
        "search_epochs": 10,
        "final_epochs": 50,
        "max_train_samples": None,
        "plateau_patience": 0,
        "search_budget": None,
        "flop_cap": None,
    },
}

# A search config's record (client reports, resume keys) keeps the shape of the one SearchConfig that
# held every strategy's options before the per-strategy configs (#19): each key below, the config's own
# fields at their values and the other strategies' at their old defaults, so the report of a run made
# before the split still matches its config on resume. (The old ``paper`` preset also set some of the
# other strategies' fields; those records differ. ``epochs`` is ``search_epochs`` since #33: records
# written before hold the old key, which a replay refuses by name and a resume does not match.)
RECORD_DEFAULTS: dict[str, Any] = {
    "strategy": "pso",
    "particles": 6,
    "iterations": 3,
    "search_epochs": 1,
    "repeats": 1,
    "final_epochs": 8,
    "cg": 0.5,
    "lr": 1e-3,
    "batch_size": 64,
    "fixed_arch": "C32k5-P-C64k5-P-F10",
    "max_train_samples": 2000,
    "max_depth": 10,
    "population": 24,
    "mutations": 12,
    "crossovers": 12,
    "generations": 5,
    "reevaluate": 3,
    "supernet": None,
    "calib_batches": 8,
    "warm_start": True,
    "finalists": 3,
    "finalist_share": 0.25,
    "finalist_keep": 0.5,
    "finalists_beat_warm": True,
    "plateau_patience": 2,
    "plateau_min_epochs": 4,
    "plateau_min_delta": 0.01,
    "augment": "auto",
    "schedule": "auto",
    "weight_decay": None,
    "search_budget": None,
    "flop_cap": None,
    "rest_on_all": None,
}


def check_arch(name: str, text: object) -> None:
    """``text`` must parse as an architecture spec (:func:`edge_sdk.models.arch.parse_arch`)."""
    if not isinstance(text, str):
        raise ConfigError(f"{name} must be an architecture spec string, got {text!r}")
    try:
        parse_arch(text)
    except SpecError as err:
        raise ConfigError(f"{name} {text!r} is not a valid spec: {err}") from err


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """Options of candidate training and of the final training, shared by every strategy.

    A strategy's config subclasses this with its own fields (:class:`edge_sdk.strategies.pso.PSOConfig`,
    ...); ``strategy`` names it in :data:`edge_sdk.search.STRATEGIES`. The defaults are the ``fast``
    preset; ``preset("paper")`` is pFedZKD section 4.1.2.

    Attributes:
        search_epochs: epochs each candidate architecture trains for its fitness (the search's short
            training).
        final_epochs: epochs the client trains the chosen architecture for after the search; none: from
            the input's training recipe, more where it augments the images (augmented training needs
            more passes before the augmentation pays).
        lr: Adam learning rate of the candidates' and the final training.
        batch_size: batch size of the candidates' and the final training (and of the memory estimate).
        max_train_samples: train each candidate on a seeded random subset this large (none: the whole
            split); a speed knob, fitness is still measured on the whole validation split.
        plateau_patience: the final training stops once its validation loss, measured after every
            epoch, has not fallen by more than the minimum improvement for this many epochs: epochs
            after the curve flattened buy the device nothing. 0 trains every final epoch; none: from
            the recipe, off under a decaying learning rate (whose curve falls at the schedule's end).
        plateau_min_epochs: the fewest epochs of final training before the plateau rule may stop it.
        plateau_min_delta: the fall of the validation loss, as a share of its best so far, that still
            counts as progress for the plateau rule.
        augment: the candidates' and the final training's augmentation: random crops from a padded
            border and horizontal flips (crop-flip), none, or auto: crop-flip for color images, none for
            grayscale ones, where a mirrored or shifted digit is another digit or leaves its frame.
        schedule: the learning rate over each training run: constant, cosine (decaying to 0 over the
            run), or auto: cosine for color images, constant for grayscale.
        weight_decay: Adam's L2 penalty of the candidates' and the final training; none: from the
            input (some for color images, none for grayscale).
        search_budget: the training FLOPs the search may spend, as a multiple of the final training's
            planned FLOPs (the device plan's, at the warm-start design): once spent, no new candidate
            starts and the search keeps the best it met. A device that trains longer may look longer,
            and the search never costs the device more than a fixed share of the training it chooses
            for. none: the search runs its whole plan.
        flop_cap: the most FLOPs per image a candidate may cost, as a multiple of the design the device
            plan prices (the warm start, where it fits the profile): the search looks for a better model
            at the price the plan stated, which then bounds the final training and the server's passes
            through the teacher. none: the profile's max_flops alone.
        rest_on_all: the chosen design's epochs after the finalists' choice train on the validation
            images too: once the validation split has chosen, a device of a few thousand images has none
            to hold back, and the model it uploads learns from all of them. The bundle's validation
            numbers stay those measured before (at the choice). none: where no plateau rule reads the
            validation curve to the end (the augmented recipe).
    """

    strategy: ClassVar[str]
    # the strategy's own preset values, merged over SHARED_PRESETS
    own_presets: ClassVar[dict[str, dict[str, Any]]] = {}
    # fields renamed, old name -> new (common.configs: the old key and flag are refused naming the new)
    renamed_keys: ClassVar[dict[str, str]] = {"epochs": "search_epochs"}

    search_epochs: int = 1
    final_epochs: int | None = None
    lr: float = 1e-3
    batch_size: int = 64
    max_train_samples: int | None = 2000
    plateau_patience: int | None = None
    plateau_min_epochs: int = 4
    plateau_min_delta: float = 0.01
    augment: Augment = "auto"
    schedule: Schedule = "auto"
    weight_decay: float | None = None
    search_budget: float | None = 0.125
    flop_cap: float | None = 1.0
    rest_on_all: bool | None = None

    def __post_init__(self) -> None:
        if type(self) is SearchConfig:
            raise ConfigError("SearchConfig holds the shared options; build a strategy's config instead")
        check_int("search_epochs", self.search_epochs, 1)
        if self.final_epochs is not None:
            check_int("final_epochs", self.final_epochs, 0)
        check_int("batch_size", self.batch_size, 1)
        if self.plateau_patience is not None:
            check_int("plateau_patience", self.plateau_patience, 0)
        check_int("plateau_min_epochs", self.plateau_min_epochs, 1)
        check_number("plateau_min_delta", self.plateau_min_delta)
        if self.max_train_samples is not None:
            check_int("max_train_samples", self.max_train_samples, 1)
        if not (isinstance(self.lr, int | float) and math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr must be a positive finite number, got {self.lr!r}")
        check_recipe(self.augment, self.schedule, self.weight_decay)
        if self.search_budget is not None and not (is_number(self.search_budget) and self.search_budget > 0):
            raise ConfigError(
                f"search_budget must be a positive finite number or None, got {self.search_budget!r}; fix: "
                "the search's FLOPs as a multiple of the final training's planned FLOPs (None: no budget)"
            )
        if self.rest_on_all is not None and not isinstance(self.rest_on_all, bool):
            raise ConfigError(f"rest_on_all must be true, false or none, got {self.rest_on_all!r}")
        if self.flop_cap is not None and not (is_number(self.flop_cap) and self.flop_cap > 0):
            raise ConfigError(
                f"flop_cap must be a positive finite number or None, got {self.flop_cap!r}; fix: a "
                "candidate's FLOPs per image as a multiple of the planned design's (None: max_flops alone)"
            )

    def for_input(self: _Config, input_shape: tuple[int, int, int]) -> _Config:
        """This config with ``final_epochs`` and ``plateau_patience`` given for images of
        ``input_shape`` (C, H, W): a None one takes what the input's recipe calls for (see
        :data:`AUGMENTED_FINAL_EPOCHS`); given ones are kept. Where a config meets its data (the search,
        a device run, a resume's key) it is resolved first, so what a report records is what ran."""
        recipe = resolve_recipe(
            input_shape, augment=self.augment, schedule=self.schedule, weight_decay=self.weight_decay
        )
        final_epochs, patience = self.final_epochs, self.plateau_patience
        if final_epochs is None:
            final_epochs = AUGMENTED_FINAL_EPOCHS if recipe.pad else PLAIN_FINAL_EPOCHS
        if patience is None:
            patience = 0 if recipe.schedule == "cosine" else PLATEAU_PATIENCE
        resolved = dataclasses.replace(self, final_epochs=final_epochs, plateau_patience=patience)
        if getattr(self, "fixed_arch", "") is None:  # the strategies that start from a hand-made design
            warm = AUGMENTED_WARM_START if recipe.pad else PLAIN_WARM_START
            resolved = dataclasses.replace(resolved, fixed_arch=warm)  # type: ignore[call-arg]
        return resolved

    def resolved_final_epochs(self) -> int:
        """``final_epochs``, given or resolved for the input by :meth:`for_input`."""
        return self._given("final_epochs")

    def _given(self, name: str) -> int:
        value = getattr(self, name)
        if value is None:
            raise ConfigError(
                f"{name} follows the input when None: resolve the config with for_input(input_shape) "
                f"first, or give {name}"
            )
        return int(value)

    def recipe(self) -> dict[str, Any]:
        """The training recipe's options, as :class:`edge_sdk.train.TrainConfig` and
        :func:`edge_sdk.final_training.train_final` take them (resolved per input when training)."""
        return {"augment": self.augment, "schedule": self.schedule, "weight_decay": self.weight_decay}

    def finalist_epochs(self) -> int:
        """Epochs every finalist trains before all but the best stop (``final_epochs``: one finalist)."""
        return self.resolved_final_epochs()

    def final_training_epochs(self) -> int:
        """Epochs of final training the device pays for one finalist: its own and the shared ones of the
        others (the time budget screens candidates on this)."""
        return self.resolved_final_epochs()

    def plateau(self) -> Callable[[Sequence[float]], bool] | None:
        """The plateau rule of the final training over its validation losses so far (None: off)."""
        patience = self._given("plateau_patience")
        if patience == 0:
            return None
        return functools.partial(
            plateaued,
            patience=patience,
            min_epochs=self.plateau_min_epochs,
            min_delta=self.plateau_min_delta,
        )

    def rests_on_all(self) -> bool:
        """Whether the chosen design trains its last epochs on the validation images too
        (``rest_on_all``, none resolved: where the plateau rule is off)."""
        stops = self.plateau() is not None
        if self.rest_on_all and stops:
            raise ConfigError(
                "rest_on_all trains on the validation images the plateau rule reads: set "
                "plateau_patience 0 or rest_on_all false"
            )
        return not stops if self.rest_on_all is None else self.rest_on_all

    def rng_streams(self) -> int:
        """Independent random streams the strategy draws from (PSO: one per repeat)."""
        return 1

    def planned_candidates(self) -> int:
        """Evaluations the progress bar expects."""
        return 1

    def to_dict(self) -> dict[str, Any]:
        """The record of this config: :data:`RECORD_DEFAULTS`' keys (see there why), JSON-friendly."""
        own = {"strategy": self.strategy} | dataclasses.asdict(self)
        assert set(own) <= set(RECORD_DEFAULTS), sorted(set(own) - set(RECORD_DEFAULTS))
        return {key: own.get(key, default) for key, default in RECORD_DEFAULTS.items()}

    @classmethod
    def preset(cls: type[_Config], name: str, **overrides: Any) -> _Config:
        """The named preset (``fast`` or ``paper``) of this strategy, with any field overridden by keyword."""
        presets = {key: values | cls.own_presets.get(key, {}) for key, values in SHARED_PRESETS.items()}
        return from_preset(cls, presets, name, "search", **overrides)
