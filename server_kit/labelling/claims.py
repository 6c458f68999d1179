"""The claim checks the synthesis phase runs as soon as their evidence exists: the classifiers' label counts
against each other (:mod:`server_kit.labelling.trust`), the decoders' against the teachers
(:mod:`server_kit.labelling.decoder_trust`)."""

from __future__ import annotations

from server_kit.labelling.decoder_trust import verify_decoders
from server_kit.labelling.trust import verify_claims
from server_kit.synthesis import ClaimChecks

__all__ = ["CLAIM_CHECKS"]

CLAIM_CHECKS = ClaimChecks(classifiers=verify_claims, decoders=verify_decoders)  # what synthesis runs
