"""shepherd."""
