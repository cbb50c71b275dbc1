"""Policy wrappers on numpy and pydantic alone: the instruction injection and the correction-rule wrappers."""
