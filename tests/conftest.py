"""Shared test setup: CPU only, one thread per process (CI machines have 2 cores), and decoded-image
caches in the session's temporary folder, never the user's ~/.cache."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from edge_sdk.image_cache import CACHE_ENV

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _image_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("image-cache")))
        yield
