"""The embedded vision-language policy refuses an observation it cannot read rather than answering it: a float
image with a NaN (which a cast would turn into some byte) or out of [0, 1], a state that is not finite."""

from __future__ import annotations

import numpy as np
import pytest

from rescue.embedded.vision_language import IMAGE_KEY, PROMPT_KEY, STATE_KEY, WRIST_KEY, VisionLanguagePolicy, parse_image

pytestmark = pytest.mark.fast


def _obs(image, state=None) -> dict:
    return {IMAGE_KEY: image, WRIST_KEY: np.zeros((224, 224, 3), np.uint8), STATE_KEY: np.zeros(8) if state is None else state,
            PROMPT_KEY: "pick up the ketchup and place it in the basket"}


@pytest.mark.parametrize("bad", [np.nan, np.inf, -0.5, 1.5])
def test_a_float_image_it_cannot_read_is_refused(bad):
    image = np.full((224, 224, 3), 0.5)
    image[3, 4, 1] = bad
    with pytest.raises(ValueError, match=r"finite values in \[0, 1\]"):
        parse_image(image)
    reader = object.__new__(VisionLanguagePolicy)  # the contract's check alone, no network loaded
    with pytest.raises(ValueError):
        reader.read(_obs(image))


def test_a_state_that_is_not_finite_is_refused_and_a_good_observation_reads():
    reader = object.__new__(VisionLanguagePolicy)
    state = np.zeros(8)
    state[2] = np.nan
    with pytest.raises(ValueError, match="not finite"):
        reader.read(_obs(np.zeros((224, 224, 3), np.uint8), state))
    image, got, prompt = reader.read(_obs(np.full((224, 224, 3), 0.5)))
    assert image.dtype == np.uint8 and image[0, 0, 0] == 127 and got.shape == (8,) and prompt.startswith("pick")
