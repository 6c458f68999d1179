"""The device's plan before it starts: the training FLOPs a client run will spend and the time that takes
at its profile's throughput, and afterwards what it spent, so a user knows what a run costs before paying
for it and the report says how close the estimate was.

Counted as :mod:`edge_sdk.profiling` counts them: a trained image costs ``TRAIN_FLOP_FACTOR`` forward
passes, a validated one one forward pass. Before the search the architecture is unknown, so every
classifier forward is priced at a reference model: the strategy's ``fixed_arch`` (PSO's warm start, the
``fixed`` baseline) where it has a formula and fits ``max_flops``, else ``max_flops`` (the most any
candidate may cost). The search is planned at its full plan of candidates (the cache and a time budget
make it do fewer), the final training at the halving schedule's epochs (a plateau stop ends it sooner).
The search's FLOP cap (``SearchConfig.flop_cap``, the reference's own price by default) keeps candidates
from costing more than the reference per image, so the plan bounds them; without it a larger candidate
makes the search and the final training cost more than planned. The achieved throughput is rarely the
profile's: the report's ``device_plan`` records both sides so the estimate can be judged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from edge_sdk.cvae import CVAEConfig, cvae_cost, fit_width
from edge_sdk.models.arch import analytic_cost, parse_arch, with_num_classes
from edge_sdk.profiling import TRAIN_FLOP_FACTOR, trains_in_time
from edge_sdk.strategies.base import SearchConfig
from profiles import DeviceProfile

__all__ = [
    "actual_flops",
    "affordable_final_epochs",
    "compare",
    "final_training_flops",
    "pass_flops",
    "plan_flops",
    "plan_line",
    "reference_flops",
    "search_flop_budget",
]


def reference_flops(
    config: SearchConfig, profile: DeviceProfile, input_shape: tuple[int, int, int], num_classes: int
) -> int:
    """FLOPs per image the plan prices a classifier at (module docstring)."""
    text = getattr(config, "fixed_arch", None)
    if text is not None:
        cost = analytic_cost(with_num_classes(parse_arch(text), num_classes), input_shape, num_classes)
        if cost is not None and cost[0] <= profile.max_flops:
            return int(cost[0])
    return int(profile.max_flops)


def pass_flops(flops: int, epochs: int, trained: int, validated: int) -> int:
    """``epochs`` of training on ``trained`` images and a validation pass over ``validated`` each."""
    return int(flops * epochs * (TRAIN_FLOP_FACTOR * trained + validated))


def final_training_flops(
    config: SearchConfig,
    profile: DeviceProfile,
    *,
    n_train: int,
    n_val: int,
    input_shape: tuple[int, int, int],
    num_classes: int,
    searched: bool = True,
) -> int:
    """The final training's planned FLOPs: the halving schedule's epochs (``searched`` False: the given
    weights' ``final_epochs``) at the reference model, validated every epoch where the plateau rule runs."""
    flops = reference_flops(config, profile, input_shape, num_classes)
    epochs = config.final_training_epochs() if searched else config.resolved_final_epochs()
    validated = n_val if config.plateau() is not None else n_val / max(epochs, 1)
    planned = pass_flops(flops, epochs, n_train, int(validated))
    if searched and config.rests_on_all():  # the winner's epochs after the choice see n_val images more
        rest = config.resolved_final_epochs() - min(config.finalist_epochs(), config.resolved_final_epochs())
        planned += pass_flops(flops, rest, n_val, 0)
    return planned


def affordable_final_epochs(
    config: SearchConfig,
    profile: DeviceProfile,
    *,
    n_train: int,
    input_shape: tuple[int, int, int],
    num_classes: int,
) -> int:
    """``config``'s final epochs (resolved), or fewer where the device's budget cannot pay for them: the
    most whose final training of the design the plan prices (the finalists' shared epochs included) fits
    the time every candidate is screened against (:func:`edge_sdk.profiling.trains_in_time`: a share of
    ``time_budget_s`` at the profile's GFLOP/s). At least one epoch where the config asks for any: a
    device too slow even for that has its candidates refused by the screen, which says why."""
    most = config.resolved_final_epochs()
    flops = reference_flops(config, profile, input_shape, num_classes)
    for epochs in range(most, 0, -1):
        planned = dataclasses.replace(config, final_epochs=epochs).final_training_epochs()
        if trains_in_time(flops, n_train, planned, profile) is None:
            return epochs
    return min(most, 1)


def search_flop_budget(config: SearchConfig, final_flops: int) -> int | None:
    """The training FLOPs the search may spend: ``config.search_budget`` times ``final_flops``, the final
    training's planned FLOPs (:func:`final_training_flops`); None: no FLOP budget."""
    if config.search_budget is None:
        return None
    return int(config.search_budget * final_flops)


def _cvae_flops(
    config: CVAEConfig, profile: DeviceProfile, input_shape: tuple[int, int, int], num_classes: int
) -> int:
    """Training forward FLOPs per image of the whole CVAE (encoder and decoder) at the width the device
    will train (:func:`edge_sdk.cvae.fit_width`)."""
    fitted = fit_width(config, profile, input_shape, num_classes)
    return int(cvae_cost(fitted, input_shape, num_classes).model.flops)


def plan_flops(
    *,
    search: SearchConfig | None,
    cvae: CVAEConfig | None,
    searched: bool = True,
    profile: DeviceProfile,
    n_train: int,
    n_val: int,
    input_shape: tuple[int, int, int],
    num_classes: int,
) -> dict[str, Any]:
    """The planned FLOPs per phase (``search``, ``final_training``, ``cvae``; None: the role skips it),
    their total and the estimated seconds at ``profile.gflops``. ``searched`` False: the classifier
    trains given weights (no search; its ``final_epochs`` alone)."""
    plan: dict[str, Any] = {"search": 0, "final_training": 0, "cvae": 0}
    if search is not None:
        flops = reference_flops(search, profile, input_shape, num_classes)
        subset = min(n_train, search.max_train_samples or n_train)
        shape = {"n_train": n_train, "n_val": n_val, "input_shape": input_shape, "num_classes": num_classes}
        plan["reference_flops_per_image"] = flops
        plan["final_training"] = final_training_flops(search, profile, searched=searched, **shape)
        if searched:
            candidate = pass_flops(flops, 1, search.search_epochs * subset, n_val)
            plan["search"] = candidate * search.planned_candidates()
            budget = search_flop_budget(search, plan["final_training"])
            if budget is not None:  # the search stops once it spent its budget (one candidate past)
                plan["search"] = min(plan["search"], budget + candidate)
    if cvae is not None:
        flops = _cvae_flops(cvae, profile, input_shape, num_classes)
        plan["cvae"] = pass_flops(flops, cvae.epochs, n_train, 0) + flops * n_val
    plan["total"] = plan["search"] + plan["final_training"] + plan["cvae"]
    plan["gflops"] = float(profile.gflops)
    plan["seconds"] = round(plan["total"] / (profile.gflops * 1e9), 3)
    return plan


def actual_flops(
    *,
    candidates: Iterable[tuple[int, int]],
    finalists: Iterable[Mapping[str, Any]],
    search_subset: int,
    val_every_epoch: bool,
    cvae_flops: int | None,
    cvae_epochs: int,
    n_train: int,
    n_val: int,
) -> dict[str, int]:
    """The FLOPs a run spent per phase, counted the plan's way from what it trained: every candidate the
    search trained, as (FLOPs per image, epochs) on ``search_subset`` images (cache hits and rejections
    train nothing: epochs 0), every finalist row of the report (its epochs; validated every epoch where
    the plateau rule ran, else once), the CVAE's epochs (``cvae_flops`` None: no CVAE)."""
    spent = {"search": 0, "final_training": 0, "cvae": 0}
    for flops, epochs in candidates:
        if epochs > 0:
            spent["search"] += pass_flops(flops, 1, epochs * search_subset, n_val)
    for row in finalists:
        epochs = row.get("final_epochs", row["epochs"])
        validated = n_val * epochs if val_every_epoch else n_val
        spent["final_training"] += pass_flops(row["flops"], epochs, n_train, 0) + row["flops"] * validated
        # epochs that trained on the validation images too (rest_on_all)
        spent["final_training"] += pass_flops(row["flops"], row.get("epochs_on_all", 0), n_val, 0)
    if cvae_flops is not None:
        spent["cvae"] = pass_flops(cvae_flops, cvae_epochs, n_train, 0) + cvae_flops * n_val
    spent["total"] = sum(spent.values())
    return spent


def compare(plan: dict[str, Any], spent: dict[str, int], seconds: float) -> dict[str, Any]:
    """The report's ``device_plan``: planned and spent FLOPs, estimated and measured seconds of the
    training phases, their ratios (1.0: the estimate was exact) and the throughput achieved."""
    return {
        "planned": plan,
        "actual": spent | {"seconds": round(seconds, 3)},
        "actual_over_planned": {
            "flops": round(spent["total"] / plan["total"], 4) if plan["total"] else None,
            "seconds": round(seconds / plan["seconds"], 4) if plan["seconds"] else None,
        },
        "achieved_gflops": round(spent["total"] / seconds / 1e9, 3) if seconds > 0 else None,
    }


def plan_line(plan: dict[str, Any], profile: DeviceProfile) -> str:
    """The line `edge-sdk run` logs before it starts."""
    parts = ", ".join(
        f"{name.replace('_', ' ')} {plan[name] / 1e12:.3g}" for name in ("search", "final_training", "cvae")
    )
    priced = plan.get("reference_flops_per_image")
    at = f"; classifiers priced at {priced / 1e6:.3g} MFLOP per image" if priced else ""
    return (
        f"plan: {plan['total'] / 1e12:.3g} TFLOP of training ({parts}), about {plan['seconds']:.0f} s at "
        f"{plan['gflops']:g} GFLOP/s (profile {profile.name!r}{at})"
    )
