"""What the embedding cache saves: the embedded vision-language policy's start in a fresh process, ROUNDS times each way.

    .venv/bin/python benchmarks/embedding_cache.py [ROUNDS]

Per round, three fresh processes each make the policy (`make_policy`) and embed a task's instruction and a
subgoal injected into it, as its first query does: with the cache off (`RESCUE_EMBEDDING_CACHE=off`: the
sentence model is loaded), with an empty cache (loaded, then the embeddings kept) and with that cache warm.
Each prints the whole process's CPU (imports included), whether it loaded the sentence model, and a digest
of the embeddings' bytes: the three must agree.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from cache_rounds import cache_rounds, verdict

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import hashlib, json, os, sys
from rescue.embedded.learned import text_features
from rescue.embedded.vision_language import make_policy
from wrappers.injection import inject
policy = make_policy()
task = "pick up the bbq sauce and place it in the basket"
features = [text_features(task), text_features(inject(task, "pick up the bbq sauce"))]
t = os.times()
print(json.dumps({"cpu_s": t.user + t.system, "model_loaded": "sentence_transformers" in sys.modules,
                  "digest": hashlib.sha256(b"".join(f.tobytes() for f in features)).hexdigest()}))
"""


def start(cache: str) -> dict:
    """One policy start in a fresh process with the cache set to `cache`."""
    env = {**os.environ, "RESCUE_EMBEDDING_CACHE": cache, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    runs = cache_rounds(rounds, start, "embedding-cache-")
    print(f"the embedded vision-language policy's start and first embeddings, {rounds} rounds")
    for name, rs in runs.items():
        loaded = {r["model_loaded"] for r in rs}
        print(f"  {name:5s} process CPU {statistics.median(r['cpu_s'] for r in rs):5.2f} s (median); "
              f"sentence model loaded: {'yes' if loaded == {True} else 'no' if loaded == {False} else 'sometimes'}")
    verdict(runs, "digest", "embeddings")

if __name__ == "__main__":
    main()
