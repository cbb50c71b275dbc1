"""Check an installed `rescue` from any directory: its packaged prompt and models are found and used.

Run it with the installed interpreter from a directory outside the source tree.
It serves the local VLM endpoint (`rescue serve-vlm`, which answers with the
packaged subgoal model), asks it for one subgoal through the VLM client (which
renders the packaged prompt template), and runs the packaged learned policy and
the packaged vision-language policy on one synthetic observation each. It prints one JSON object of what it found and exits
non-zero when a check fails. About 20 s; no simulator.

    python scripts/check_install.py            # from the installed environment
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

INSTRUCTION = "pick up the bbq sauce and place it in the basket"


def serve_vlm() -> tuple[subprocess.Popen, str]:
    """Start `rescue serve-vlm` on a free port; return the process and its base URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", "serve-vlm", "--port", "0"], stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()  # "serving an OpenAI-compatible endpoint at http://127.0.0.1:PORT/v1 ..."
    if " at " not in line:
        proc.kill()
        raise SystemExit(f"rescue serve-vlm did not start: {line!r}")
    return proc, line.split(" at ", 1)[1].split()[0]


async def ask_subgoal(base_url: str, receipts: Path):
    """One subgoal for one synthetic case, through the real client (and so the packaged template)."""
    from rescue.core.configuration.vlm_config import VLMConfig
    from rescue.core.images import VLM_VIEWS
    from rescue.study.receipts import ReceiptLog
    from rescue.vlm.answers import SubgoalRequest
    from rescue.vlm.client import VLMClient

    rng = np.random.default_rng(0)
    views = {name: rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for name in VLM_VIEWS}
    client = VLMClient(VLMConfig(base_url=base_url, request_timeout_s=60.0, max_attempts=2), ReceiptLog(receipts))
    try:
        return await client.ask(SubgoalRequest("install-check", INSTRUCTION, 120, views))
    finally:
        await client.aclose()


def main() -> int:
    """Run the checks; print what was found; 0 when all hold."""
    import rescue
    import rescue_serve
    from rescue.core.prompts import DEFAULT_ROOT, load_template
    from rescue.embedded.learned import DEFAULT_CHECKPOINT, LearnedPolicy
    from rescue.embedded.phases import PHASES, parse_pick_place, sub_instruction
    from rescue.embedded.subgoal_model import DEFAULT_CHECKPOINT as VISION_CHECKPOINT
    from rescue.embedded.vision_language import DEFAULT_LOCATOR, VisionLanguagePolicy

    # Not resolved: in a checkout, rescue/assets/ links to the top-level folders.
    package = Path(rescue.__file__).parent
    found = {
        "rescue": str(package),
        "rescue_serve": str(Path(rescue_serve.__file__).parent),
        "cwd": str(Path.cwd()),
        "prompts": str(DEFAULT_ROOT),
        "template_sha256": load_template("subgoal_v1").sha256,
        "policy_checkpoint": str(DEFAULT_CHECKPOINT),
        "vision_checkpoint": str(VISION_CHECKPOINT),
        "locator_checkpoint": str(DEFAULT_LOCATOR),
    }
    proc, base_url = serve_vlm()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            answer = asyncio.run(ask_subgoal(base_url, Path(tmp) / "receipts.jsonl"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    found |= {"status": answer.status, "subgoal": answer.subgoal}
    found["receipt_template_sha256"] = answer.receipt.prompt_template_sha256 if answer.receipt else None
    obs = {
        "robot0_eef_pos": [0.0, 0.0, 1.0],
        "robot0_gripper_qpos": [0.04, -0.04],
        "task/object_pos": [0.05, 0.1, 0.9],
        "task/target_pos": [-0.1, 0.2, 0.9],
        "prompt": INSTRUCTION,
    }
    actions = np.asarray(LearnedPolicy().infer(obs)["actions"])
    found["policy_actions_shape"] = list(actions.shape)
    # The vision-language policy on an observation shaped as the openpi-libero profile sends it.
    rng = np.random.default_rng(0)
    contract = {
        "observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/state": np.zeros(8),
        "prompt": INSTRUCTION,
    }
    vl_actions = np.asarray(VisionLanguagePolicy().infer(contract)["actions"])
    found["vision_language_actions_shape"] = list(vl_actions.shape)

    # The subgoal model's answers are phase sub-instructions; without the model file the
    # endpoint falls back to a rule whose wording ("... again, then ...") is none of these.
    goal = parse_pick_place(INSTRUCTION)
    model_answers = {sub_instruction(phase, goal) for phase in PHASES}
    checks = {
        "package outside the working directory": not package.resolve().is_relative_to(Path.cwd().resolve()),
        "serving package installed beside it": Path(rescue_serve.__file__).parent.parent == package.parent,
        "template inside the package": DEFAULT_ROOT.is_relative_to(package),
        "checkpoints inside the package": all(
            Path(p).is_relative_to(package) and Path(p).is_file()
            for p in (DEFAULT_CHECKPOINT, VISION_CHECKPOINT, DEFAULT_LOCATOR)
        ),
        "answer from the subgoal model": answer.status == "ok" and answer.subgoal in model_answers,
        "receipt names the packaged template": found["receipt_template_sha256"]
        == hashlib.sha256((DEFAULT_ROOT / "subgoal_v1.txt").read_bytes()).hexdigest(),
        "policy answers a chunk": actions.ndim == 2 and actions.shape[1] == 7 and np.isfinite(actions).all(),
        "vision-language policy answers a chunk": vl_actions.shape == (8, 7) and np.isfinite(vl_actions).all(),
    }
    found["failed"] = [name for name, ok in checks.items() if not ok]
    print(json.dumps(found))
    return 1 if found["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
