"""Search spaces: what a search may draw, as specs (never torch modules). One space per module; the
:class:`~edge_sdk.spaces.registry.SearchSpace` interface and the registry are in :mod:`.registry`."""
