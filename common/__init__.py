"""The shared core under every package: the error hierarchy, the validators, device resolution and the
training plumbing that ``profiles``, ``export``, ``edge_sdk`` and ``server_kit`` all use (Flower's
``flwr.common`` habit). It imports nothing of the toolkit; its ``__init__`` imports nothing at all, so a
board that only reads profiles does not pay for torch."""
