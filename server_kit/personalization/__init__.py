"""Personalization: one model per client from the server's synthetic set (FedPD's PKE packages), the
data-free supernet and heteroFedAvg through it."""

from server_kit.personalization.hetero_avg import hetero_avg, hetero_fedavg
from server_kit.personalization.pke import PKEConfig, PKEResult, personalize_server, train_server_models
from server_kit.personalization.supernet import SupernetConfig, supernet_from_bundles, train_supernet

__all__ = [
    "PKEConfig",
    "PKEResult",
    "SupernetConfig",
    "hetero_avg",
    "hetero_fedavg",
    "personalize_server",
    "supernet_from_bundles",
    "train_server_models",
    "train_supernet",
]
