"""labelling phase of the server pipeline."""
