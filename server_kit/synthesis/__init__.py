"""Synthesis: pseudo-images made without real data, from the teachers (inversion, a generator) or the
uploaded CVAE decoders, each a source of the registry ``SOURCES``, pooled; the set kept on disk."""

from server_kit.synthesis.decoders import filter_by_centroid, load_decoder, sample_decoders
from server_kit.synthesis.generator import (
    ConditionalGenerator,
    GeneratorConfig,
    sample_generator,
    train_generator,
)
from server_kit.synthesis.inversion import InversionConfig, SyntheticSet
from server_kit.synthesis.sources import (
    SOURCES,
    SYNTH_SOURCES,
    WORK_DIRS,
    ClaimChecks,
    DecoderConfig,
    DecoderPool,
    Synthesis,
    SynthesisConfig,
    clear_work_dirs,
    synthesize,
    usable_decoders,
)
from server_kit.synthesis.store import SYNTHETIC_FILE, load_synthetic, save_synthetic
from server_kit.synthesis.views import VIEWS, check_views, with_views

__all__ = [
    "SOURCES",
    "SYNTHETIC_FILE",
    "SYNTH_SOURCES",
    "VIEWS",
    "WORK_DIRS",
    "ClaimChecks",
    "ConditionalGenerator",
    "DecoderConfig",
    "DecoderPool",
    "GeneratorConfig",
    "InversionConfig",
    "Synthesis",
    "SynthesisConfig",
    "SyntheticSet",
    "check_views",
    "clear_work_dirs",
    "filter_by_centroid",
    "load_decoder",
    "load_synthetic",
    "sample_decoders",
    "sample_generator",
    "save_synthetic",
    "synthesize",
    "train_generator",
    "usable_decoders",
    "with_views",
]
