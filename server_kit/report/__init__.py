"""report phase of the server pipeline."""
