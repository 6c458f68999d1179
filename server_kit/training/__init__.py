"""training phase of the server pipeline."""
