"""Training: the global model from the labelled synthetic set (distillation, DENSE's adversarial rounds,
FedMHO's FedAvg start and fusion)."""

from server_kit.training.adversarial import AdversarialConfig, adversarial_distill
from server_kit.training.distill import DistillConfig, distill
from server_kit.training.fedavg import average_state_dicts, fedavg_init
from server_kit.training.fusion import FusionConfig, fuse
from server_kit.training.global_model import Training, TrainingConfig, export_global, train_global

__all__ = [
    "AdversarialConfig",
    "DistillConfig",
    "FusionConfig",
    "Training",
    "TrainingConfig",
    "adversarial_distill",
    "average_state_dicts",
    "distill",
    "export_global",
    "fedavg_init",
    "fuse",
    "train_global",
]
