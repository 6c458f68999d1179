"""The elastic family (HAPFNAS): :mod:`.spec` (a subnet as a string, the space's choices, the analytic
cost), :mod:`.network` (a subnet's static torch module and registry entry), :mod:`.supernet` (the
weight-sharing supernet, slicing and extraction), :mod:`.supernet_file` (its code-free file), :mod:`.space`
(the search space: sampling, mutation, crossover, encoding)."""
