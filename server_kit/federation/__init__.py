"""Federation: a whole federation in one call (partition, clients in worker processes, the server, the
report), what a rerun may resume, and the Flower ServerApp (``federation.flower_server``, the optional
``[flower]`` extra, imported by its own path)."""

from server_kit.federation.simulate import (
    RESUME_MODES,
    SimulateConfig,
    SimulateResult,
    plan_clients,
    simulate,
)

__all__ = ["RESUME_MODES", "SimulateConfig", "SimulateResult", "plan_clients", "simulate"]
