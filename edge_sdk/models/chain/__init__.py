"""The chain family (pFedZKD): :mod:`.spec` (a C/R/P/F chain as a string, its rules and analytic cost),
:mod:`.network` (its torch module and registry entry), :mod:`.space` (the search space: sampling, the
alignment operator T, mutation, crossover, encoding)."""
