"""The architecture families: what a model is (a spec that travels as a string), how it is built, what it
costs, and the search space a strategy draws it from.

* :mod:`.arch`: the registry of families (``FAMILIES``, ``parse_arch``, ``build_model``, ...);
* :mod:`.spaces`: the registry of search spaces (``SearchSpace``, ``SPACES``, ``get_space``);
* :mod:`.chain`: pFedZKD's C/P/F chains; :mod:`.elastic`: HAPFNAS's elastic MobileNetV3-like subnets;
* :mod:`.zoo`: the named baseline models (no search space).

A searched family is a folder with one layout: ``spec`` (the string and JSON forms, the rules, the
analytic cost; no torch), ``network`` (its torch module and its registry entry) and ``space`` (its search
operators and the family as a ``SearchSpace``); the elastic family adds its ``supernet`` and the
``supernet_file``. The spaces live here, not in a package of their own, because a space's operators are
its spec's maths (alignment repairs a chain by the chain's rules, elastic mutation draws from the elastic
``SPACE``): each family then reads in one folder, and the strategies see only the two registries.
"""
