"""Numpy-only policy wrappers: instruction injection, chunk brokering, rule wrappers."""
