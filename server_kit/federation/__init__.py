"""federation phase of the server pipeline."""
