"""Labelling: who knows what. The teachers' vote on every synthetic sample (weighted by what each holds,
abstaining teachers by p_own), the claimed label counts checked, and the top-up of thinned-out classes."""

from server_kit.labelling.labels import LabelConfig, Labels, consensus, label_synthetic, teacher_probs
from server_kit.labelling.targets import LabellingConfig, agreement, label, vote_labels
from server_kit.labelling.top_up import top_up
from server_kit.labelling.trust import CLAIM_CHECKS, ClaimCheck, verify_claims, verify_decoders

__all__ = [
    "CLAIM_CHECKS",
    "ClaimCheck",
    "LabelConfig",
    "LabellingConfig",
    "Labels",
    "agreement",
    "consensus",
    "label",
    "label_synthetic",
    "teacher_probs",
    "top_up",
    "verify_claims",
    "verify_decoders",
    "vote_labels",
]
