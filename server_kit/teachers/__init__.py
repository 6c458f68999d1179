"""teachers phase of the server pipeline."""
