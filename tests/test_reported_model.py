"""A VLM endpoint that answers as another model than the study asks for (rescue/core/reported_model.py):
refused by default, a warning when `[vlm] require_model_match = false`, and said before the first claim.
The real local endpoint over loopback, reporting a model of its choosing, through the real `openai` SDK."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from conftest import ROOT
from helpers.vlm_requests import FAST, make_request
from structlog.testing import capture_logs

from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.vlm_config import VLMConfig
from rescue.core.failfast import FailFast, PeerUnreachable
from rescue.core.records import ArmResult, Assistance
from rescue.core.reported_model import model_matches
from rescue.embedded.endpoint import EndpointOptions, start_endpoint
from rescue.run.peers import _check_one_vlm
from rescue.study.receipts import ReceiptLog, read_receipts
from rescue.vlm.client import VLMClient

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("requested, reported, same", [
    ("gpt-4.1", "gpt-4.1", True), ("gpt-4.1", "gpt-4.1-2025-04-14", True), ("gpt-4", "gpt-4-0613", True),
    ("Qwen/Qwen2.5-VL-7B", "qwen/qwen2.5-vl-7b", True), ("llava", "llava:latest", True), ("x", None, True),
    ("content-free", "hostile-v0", False), ("gpt-4.1", "gpt-4.1-mini", False), ("gpt-4.1", "gpt-4.1-mini-2025-04-14", False),
    ("llava:13b", "llava:latest", False), ("gpt-4o", "gpt-4o-2024", True), ("gpt-4o", "gpt-4o-evil", False),
])
def test_what_counts_as_the_requested_model(requested, reported, same):
    assert model_matches(requested, reported) is same


def _ask(tmp_path, reported: str, times: int = 1, **config):
    async def go():
        runner, base_url = await start_endpoint(EndpointOptions(model=reported))
        client = VLMClient(VLMConfig(base_url=base_url, model="content-free", **(FAST | config)),
                           ReceiptLog(tmp_path / "r.jsonl"), advisor="continue")
        try:
            return [await client.ask(make_request(i)) for i in range(times)]
        finally:
            await client.aclose()
            await runner.cleanup()

    with capture_logs() as logs:
        answers = asyncio.run(go())
    return answers, [e for e in logs if e["event"] == "vlm.model_mismatch"]


def test_an_answer_from_another_model_is_refused_by_default(tmp_path):
    (answer,), warned = _ask(tmp_path, "hostile-v0")
    assert answer.status == "invalid_response" and answer.subgoal is None and answer.error_kind == "model_mismatch"
    assert answer.error == ("the endpoint answered as model 'hostile-v0', not the 'content-free' the study asked for "
                            "([vlm] require_model_match)")
    outcome = read_receipts(tmp_path / "r.jsonl")[-1]
    assert outcome.status == "invalid_response" and outcome.model_reported == "hostile-v0"
    assert outcome.model_requested == "content-free" and outcome.subgoals == {answer.request_id: None}
    assert warned == []


def test_when_not_required_it_is_applied_and_warned_about_once(tmp_path):
    answers, warned = _ask(tmp_path, "hostile-v0", times=2, require_model_match=False)
    assert [a.status for a in answers] == ["ok", "ok"] and all(a.subgoal for a in answers)
    assert len(warned) == 1 and warned[0]["reported"] == "hostile-v0" and warned[0]["advisor"] == "continue"
    assert all(r.model_reported == "hostile-v0" for r in read_receipts(tmp_path / "r.jsonl") if r.kind == "outcome")


def test_a_dated_snapshot_of_the_requested_model_is_the_requested_model(tmp_path):
    async def go():
        runner, base_url = await start_endpoint(EndpointOptions(model="gpt-4.1-2025-04-14"))
        client = VLMClient(VLMConfig(base_url=base_url, model="gpt-4.1", **FAST), ReceiptLog(tmp_path / "r.jsonl"))
        try:
            return await client.ask(make_request(0))
        finally:
            await client.aclose()
            await runner.cleanup()

    assert asyncio.run(go()).status == "ok"


def test_refused_answers_of_another_model_stop_the_study_after_k_calls(tmp_path):
    answers, _ = _ask(tmp_path, "hostile-v0", times=3)
    watch = FailFast(k=3)
    stop = None
    for i, a in enumerate(answers):
        arm = ArmResult(case_id=f"c{i}", arm="assisted", status="complete", success=False, steps=48, trace=[],
                        assistance=Assistance(status="invalid_response", error_kind=a.error_kind, error=a.error))
        stop = watch.observe([arm]) or stop
    assert stop is not None and "first 3 VLM calls" in stop and "hostile-v0" in stop
    assert "require_model_match = false" in stop


async def _impostor() -> tuple[web.AppRunner, str]:
    """Another server on the advisor's port: it lists and answers as `hostile-v0`, whatever is asked."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "hostile-v0", "object": "model", "created": 0,
                                                              "owned_by": "someone"}]})

    async def chat(_: web.Request) -> web.Response:
        return web.json_response({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "hostile-v0",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "OK"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"


def _start_check(check: str, **config):
    async def go():
        runner, base_url = await _impostor()
        try:
            await _check_one_vlm(VLMConfig(base_url=base_url, model="content-free", startup_check=check, **config),
                                 "continue")
        finally:
            await runner.cleanup()

    with capture_logs() as logs:
        asyncio.run(go())
    return logs


def test_the_start_check_says_so_before_the_first_claim():
    with pytest.raises(PeerUnreachable, match=r"of advisor 'continue' at http://\S+: the endpoint answered as model "
                                               r"'hostile-v0'.*nothing was claimed"):
        _start_check("call")
    warned = _start_check("call", require_model_match=False)
    assert [e["reported"] for e in warned if e["event"] == "vlm.model_mismatch"] == ["hostile-v0"]
    listed = _start_check("models")  # a list is not an answer: said, not refused
    assert [e["listed"] for e in listed if e["event"] == "vlm.model_not_listed"] == [["hostile-v0"]]


def test_the_setting_leaves_the_digest_of_studies_made_before_it():
    # A study's configuration with two advisors as e2dc5e3 wrote it (before require_model_match and the lab
    # budget's keys), and the digest its journal recorded: both still hold.
    old = json.loads((ROOT / "tests" / "data" / "advisors_config_e2dc5e3.json").read_text())
    config = StudyConfig.model_validate(old["config"])
    assert config.sha256() == old["sha256"]
    assert config.vlm.refuses_other_models and all(a.refuses_other_models for a in config.advisors)
    off = config.model_copy(update={"vlm": config.vlm.model_copy(update={"require_model_match": False})})
    assert off.sha256() != old["sha256"]  # once set, it is part of the study's identity
