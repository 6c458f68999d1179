"""Labelling: who knows what. The teachers' vote on every synthetic sample (weighted by what each holds,
abstaining teachers by p_own), the claimed label counts checked (the classifiers' against each other, the
decoders' against the teachers), and the top-up of thinned-out classes."""

from server_kit.labelling.claims import CLAIM_CHECKS
from server_kit.labelling.decoder_trust import verify_decoders
from server_kit.labelling.labels import (
    LabelConfig,
    Labels,
    consensus,
    label_synthetic,
    teacher_probs,
    unconditioned_vote,
)
from server_kit.labelling.targets import LabellingConfig, agreement, label, mixture_labeller, vote_labels
from server_kit.labelling.top_up import top_up
from server_kit.labelling.trust import ClaimCheck, verify_claims

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
    "mixture_labeller",
    "teacher_probs",
    "top_up",
    "unconditioned_vote",
    "verify_claims",
    "verify_decoders",
    "vote_labels",
]
