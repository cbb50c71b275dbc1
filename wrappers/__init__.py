"""Numpy-only policy wrappers: the instruction injection and the correction-rule wrappers."""
