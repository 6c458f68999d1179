"""Teachers: the uploads read and held to their checks, rebuilt (or converted from ONNX) as frozen torch
modules, probed once, and run side by side; the federation every later phase is given."""

from server_kit.teachers.abstain import Abstaining, own_probability
from server_kit.teachers.counts import check_label_counts, class_shares, held_classes
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
    "Federation",
    "Teacher",
    "Uploads",
    "batch_statistics_gap",
    "batchnorm_layers",
    "charge",
    "check_label_counts",
    "class_shares",
    "classifier_weight",
    "convert_onnx",
    "declared_class_names",
    "held_classes",
    "load_teachers",
    "map_teachers",
    "own_probability",
    "read_uploads",
    "split_kinds",
    "teacher_workers",
    "teachers_from_bundles",
    "usable_teachers",
]
