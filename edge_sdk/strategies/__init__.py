"""Search strategies, one per module (Flower's habit): :mod:`.pso`, :mod:`.evolution` and the ablation
:mod:`.baselines`, each with its own config class over :class:`~edge_sdk.strategies.base.SearchConfig`,
all scoring candidates through :mod:`.evaluator`. The registry and ``search()`` are :mod:`edge_sdk.search`."""
