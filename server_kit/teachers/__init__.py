"""Teachers: the uploads read and held to their checks, rebuilt (or converted from ONNX) as frozen torch
modules, probed once, copies of one model counted once, each held to what the others cost while the
phases run, and run side by side; the federation every later phase is given."""

from server_kit.teachers.abstain import Abstaining, own_probability
from server_kit.teachers.budget import (
    BudgetConfig,
    Costs,
    Phase,
    TeacherDropped,
    guarded,
    measure_costs,
    run_guarded,
    run_within_budget,
    server_phases,
)
from server_kit.teachers.clones import weights_digest, without_clones
from server_kit.teachers.counts import check_label_counts, class_shares, held_classes, unpaired_counts
from server_kit.teachers.ensemble import Federation, charge, split_kinds, usable_teachers
from server_kit.teachers.loading import (
    Teacher,
    Uploads,
    batch_statistics_gap,
    batchnorm_layers,
    classifier_weight,
    declared_class_names,
    load_teachers,
    read_uploads,
    teachers_from_bundles,
)
from server_kit.teachers.onnx_convert import convert_onnx
from server_kit.teachers.parallel import map_teachers, teacher_workers

__all__ = [
    "Abstaining",
    "BudgetConfig",
    "Costs",
    "Federation",
    "Phase",
    "Teacher",
    "TeacherDropped",
    "Uploads",
    "batch_statistics_gap",
    "batchnorm_layers",
    "charge",
    "check_label_counts",
    "class_shares",
    "classifier_weight",
    "convert_onnx",
    "declared_class_names",
    "guarded",
    "held_classes",
    "load_teachers",
    "map_teachers",
    "measure_costs",
    "own_probability",
    "read_uploads",
    "run_guarded",
    "run_within_budget",
    "server_phases",
    "split_kinds",
    "teacher_workers",
    "teachers_from_bundles",
    "unpaired_counts",
    "usable_teachers",
    "weights_digest",
    "without_clones",
]
