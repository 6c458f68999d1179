"""personalization phase of the server pipeline."""
