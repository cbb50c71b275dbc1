"""VLM-assisted failure rescue for robot-policy evaluation."""

__version__ = "0.1.0"
