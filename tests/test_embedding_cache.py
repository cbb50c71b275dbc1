"""The embedding cache on the real sentence model: a kept embedding is the model's own output bit for bit,
a process whose texts are all kept never loads the model, and a damaged copy is computed again.

Each run is a fresh process, as a policy server or a `rescue run` is: the cache is only worth having
across processes, and a process that imported the sentence model once would hide whether it is loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, cli_env

pytestmark = pytest.mark.e2e

TEXTS = ["pick up the bbq sauce and place it in the basket", "pick up the ketchup", "pick up the bbq sauce"]
EMBED = f"""
import json, sys
from rescue.embedded.learned import embed_text
vectors = [embed_text(t).tobytes().hex() for t in {TEXTS!r}]
print(json.dumps({{"vectors": vectors, "model_loaded": "sentence_transformers" in sys.modules}}))
"""


def _embed(cache: str) -> tuple[list[str], bool, str]:
    """The embeddings of TEXTS in a fresh process with RESCUE_EMBEDDING_CACHE=cache, whether it loaded the
    sentence model, and what it said on stderr."""
    env = {**cli_env(), "RESCUE_EMBEDDING_CACHE": cache}
    proc = subprocess.run([sys.executable, "-c", EMBED], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["vectors"], out["model_loaded"], proc.stderr


def test_kept_embeddings_are_the_models_own_and_spare_loading_it(tmp_path):
    cache = tmp_path / "embeddings"
    computed, loaded_off, _ = _embed("off")
    cold, loaded_cold, _ = _embed(str(cache))
    warm, loaded_warm, _ = _embed(str(cache))
    assert loaded_off and loaded_cold and not loaded_warm
    assert computed == cold == warm  # the bytes of every vector
    assert len({*computed}) == len(TEXTS) and len(list(cache.glob("*.f32"))) == len(TEXTS)
    assert not list(cache.glob(".*.part"))  # nothing half-written left behind


def test_a_damaged_copy_is_computed_again_and_said_once(tmp_path):
    cache = tmp_path / "embeddings"
    reference, _, _ = _embed(str(cache))
    kept = sorted(cache.glob("*.f32"))[0]
    damaged = bytearray(kept.read_bytes())
    damaged[0] ^= 0x01  # the lowest bit of the first float: a value any reader would accept
    kept.write_bytes(bytes(damaged))
    again, loaded, said = _embed(str(cache))
    assert again == reference and loaded
    lines = [line for line in said.splitlines() if "embedding cache" in line]
    assert len(lines) == 1 and kept.name in lines[0] and "do not match" in lines[0], said
    assert kept.read_bytes() != bytes(damaged)  # the sound copy was written over it (same key, same digest)
