"""The simulator seam and its backends: the LIBERO adapter, simulator processes, Ray actors."""
