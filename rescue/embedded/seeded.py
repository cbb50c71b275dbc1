"""The RNG extension of the embedded policies: one seeded numpy stream, resettable and readable."""

from __future__ import annotations

import hashlib
import json

import numpy as np


class SeededNoise:
    """A policy's sampling stream: `reset_rng` restarts it, `rng_state` digests it without advancing it."""

    _rng: np.random.Generator

    def reset_rng(self, seed: int) -> None:
        """Restart the policy's random stream from a seed."""
        self._rng = np.random.default_rng(int(seed))

    def rng_state(self) -> str:
        """A digest of the random stream's state (unchanged by anything but inference)."""
        state = json.dumps(self._rng.bit_generator.state, sort_keys=True, default=int)
        return hashlib.sha256(state.encode()).hexdigest()
