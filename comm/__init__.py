"""Communication backends."""
