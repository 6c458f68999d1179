"""synthesis phase of the server pipeline."""
