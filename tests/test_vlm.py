"""The VLM client against a real local endpoint, through the real `openai` SDK over loopback."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import structlog
from conftest import HANG_S
from helpers.vlm_requests import CASES, FAST, make_request
from PIL import Image
from structlog.testing import capture_logs

from rescue.core.configuration.vlm_config import MissingAPIKey, VLMConfig
from rescue.core.images import VLM_VIEWS, encode_png
from rescue.core.prompts import load_template, render
from rescue.core.records import Receipt, Usage
from rescue.embedded.endpoint import EndpointOptions, endpoint_state, start_endpoint
from rescue.study.receipts import (
    ReceiptLog,
    check_artifacts,
    check_attempt_refs,
    check_ref,
    extra_outcomes,
    first_outcomes,
    outcomes_by_call,
    read_receipt_file,
    read_receipts,
    scan_receipts,
    unfinished_calls,
)
from rescue.study.usage import usage_summary
from rescue.vlm.answers import SubgoalRequest, check_answers, parse_answers
from rescue.vlm.client import VLMClient

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent


def run(coro):
    return asyncio.run(coro)


async def ask_all(options: EndpointOptions, receipts: Path, requests: list[SubgoalRequest], **config):
    """Start an endpoint, ask every request concurrently, stop; return answers and the endpoint state."""
    runner, base_url = await start_endpoint(options)
    client = VLMClient(VLMConfig(base_url=base_url, **(FAST | config)), ReceiptLog(receipts))
    try:
        answers = await asyncio.gather(*(client.ask(r) for r in requests))
    finally:
        await client.aclose()
        await runner.cleanup()
    return answers, endpoint_state(runner)


def ask_one(tmp_path: Path, options: EndpointOptions, request: SubgoalRequest | None = None, **config):
    answers, state = run(ask_all(options, tmp_path / "r.jsonl", [request or make_request(0)], **config))
    return answers[0], state, read_receipts(tmp_path / "r.jsonl")


# ---- the happy path, both APIs and both answer styles --------------------------------


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("structured", [True, False])
def test_subgoal_over_both_apis_and_answer_styles(tmp_path, api, structured):
    answer, state, receipts = ask_one(tmp_path, EndpointOptions(), api=api, structured=structured)
    assert answer.status == "ok" and answer.error_kind is None
    assert answer.subgoal == "grasp the black bowl between the plate and the ramekin again, then place it on the plate"
    assert state.requests[0].structured is structured
    assert state.requests[0].path.endswith("/chat/completions" if api == "chat" else "/responses")
    assert state.requests[0].n_images == 3
    outcome = receipts[-1]
    assert [r.kind for r in receipts] == ["attempt_started", "attempt", "outcome"] and outcome == answer.receipt
    assert outcome.endpoint_kind == api and outcome.status == "ok" and outcome.attempt == 1
    assert outcome.model_requested == outcome.model_reported == "rescue-advisor-v0"
    assert outcome.provider_request_id and outcome.provider_request_id.startswith("req_")
    assert outcome.request_ids == [answer.request_id] and outcome.case_ids == ["case-0"]
    assert outcome.subgoals == {answer.request_id: answer.subgoal}
    assert len(outcome.image_sha256[answer.request_id]) == 3 and len(outcome.response_sha256) == 64
    assert outcome.prompt_template == "subgoal_v1"
    assert outcome.prompt_template_sha256 == load_template("subgoal_v1").sha256
    assert outcome.usage.input_tokens > 3 * 255 and outcome.usage.output_tokens > 0
    assert outcome.usage.cached_input_tokens == 0 and outcome.usage.reasoning_tokens == 0


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("structured", [True, False])
def test_an_advisor_that_may_decline_keeps_the_instruction_in_a_receipt_like_any_other(tmp_path, api, structured):
    # DESIGN §18: offered "keep the instruction" (the declining template and schema), the endpoint keeps it.
    answer, state, receipts = ask_one(tmp_path, EndpointOptions(answer="keep"), api=api, structured=structured,
                                      may_decline=True)
    outcome = receipts[-1]
    assert (answer.status, answer.subgoal, answer.error_kind, answer.error) == ("declined", None, None, None)
    assert outcome.status == "ok" and outcome.request_status == {answer.request_id: "declined"}
    assert outcome.subgoals == {answer.request_id: None} and outcome.prompt_template == "subgoal_or_keep_v1"
    assert answer.call_id == outcome.call_id and answer.receipt_ref is not None
    # Not offered it (the study's advisor may not decline), the same endpoint answers with a subgoal.
    plain, _, _ = ask_one(tmp_path / "plain", EndpointOptions(answer="keep"), api=api, structured=structured)
    assert plain.status == "ok" and plain.subgoal
    # Offered it, the subgoal model on views it cannot read sees no progress: it advises.
    advised, _, _ = ask_one(tmp_path / "model", EndpointOptions(), api=api, structured=structured, may_decline=True)
    assert advised.status == "ok" and advised.subgoal


def test_a_declining_answer_without_a_subgoal_is_valid_only_when_it_keeps_the_instruction():
    tokens = {"r1": "t1", "r2": "t2", "r3": "t3"}
    items = [{"request_id": "r1", "token": "t1", "keep_instruction": True, "subgoal": ""},
             {"request_id": "r2", "token": "t2", "keep_instruction": False, "subgoal": ""},
             {"request_id": "r3", "token": "t3", "keep_instruction": "yes", "subgoal": "ignored"}]
    subgoals, errors = check_answers(items, tokens, 100, may_decline=True)
    assert subgoals == {"r1": None, "r2": None, "r3": None} and set(errors) == {"r2"}
    # A study whose advisor may not decline takes no "keep": an empty subgoal stays an invalid answer.
    assert set(check_answers(items, tokens, 100)[1]) == {"r1", "r2"}


def test_missing_usage_details_stay_unknown(tmp_path):
    answer, _, _ = ask_one(tmp_path, EndpointOptions(usage_details=False))
    usage = answer.receipt.usage
    assert usage.input_tokens and usage.output_tokens
    assert usage.cached_input_tokens is None and usage.reasoning_tokens is None


def test_models_route_answers_the_sdk():
    import openai

    async def go():
        runner, base_url = await start_endpoint(EndpointOptions())
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=HANG_S)
        try:
            return [m.id async for m in client.models.list()]
        finally:
            await client.close()
            await runner.cleanup()

    assert run(go()) == ["rescue-advisor-v0"]


# ---- infrastructure faults: retried -------------------------------------------------


def test_rate_limit_is_retried_after_the_retry_after_header(tmp_path):
    started = time.monotonic()
    answer, state, receipts = ask_one(
        tmp_path, EndpointOptions(fault="rate_limit", fault_count=1, retry_after_s=1), backoff_max_s=2.0
    )
    assert answer.status == "ok" and answer.receipt.attempt == 2 and state.counter == 2
    # The backoff alone would wait ~0.02 s; only the header explains a full second.
    assert time.monotonic() - started >= 1.0
    first = receipts[1]
    assert receipts[0].kind == "attempt_started" and receipts[0].attempt == 1
    assert first.kind == "attempt" and first.status == "error" and first.error_kind == "rate_limit"
    assert first.provider_request_id and first.provider_request_id != answer.receipt.provider_request_id


def test_retry_after_is_capped_by_the_maximum_backoff(tmp_path):
    # A server asking for an hour must not hold the case: the configured cap wins.
    started = time.monotonic()
    answer, state, _ = ask_one(
        tmp_path, EndpointOptions(fault="rate_limit", fault_count=2, retry_after_s=3600),
        backoff_max_s=0.3, backoff_jitter_s=0.0,
    )
    elapsed = time.monotonic() - started
    assert answer.status == "ok" and answer.receipt.attempt == 3 and state.counter == 3
    # Two waits of the 0.3 s cap at least; the bound only tells a cap from the hour asked for
    # (generous: a busy machine is slow, never an hour slow).
    assert 0.6 <= elapsed < HANG_S


def test_server_error_is_retried(tmp_path):
    answer, state, receipts = ask_one(tmp_path, EndpointOptions(fault="server_error", fault_count=2))
    assert answer.status == "ok" and answer.receipt.attempt == 3 and state.counter == 3
    assert [r.error_kind for r in receipts if r.kind == "attempt"] == ["server", "server", None]


def test_dropped_connection_is_retried(tmp_path):
    answer, state, receipts = ask_one(tmp_path, EndpointOptions(fault="drop", fault_count=1))
    assert answer.status == "ok" and answer.receipt.attempt == 2 and state.requests[0].outcome == "dropped"
    assert receipts[1].error_kind == "connection"


def test_retries_end_at_max_attempts(tmp_path):
    answer, state, receipts = ask_one(
        tmp_path, EndpointOptions(fault="server_error", fault_count=99), max_attempts=3
    )
    assert answer.status == "broker_error" and answer.error_kind == "server" and answer.subgoal is None
    assert state.counter == 3 and answer.receipt.attempt == 3 and answer.receipt.status == "error"
    assert [r.kind for r in receipts] == ["attempt_started", "attempt"] * 3 + ["outcome"]


# ---- faults that must not be retried ------------------------------------------------


def test_quota_is_a_broker_error_and_not_retried(tmp_path):
    answer, state, receipts = ask_one(tmp_path, EndpointOptions(fault="quota"))
    assert answer.status == "broker_error" and answer.error_kind == "quota"
    assert state.counter == 1 and answer.receipt.attempt == 1
    assert answer.receipt.provider_request_id is not None and answer.receipt.usage == Usage()


@pytest.mark.parametrize("structured", [True, False])
@pytest.mark.parametrize("fault", ["malformed_json", "overlong_subgoal", "empty_subgoal", "wrong_request_id"])
def test_unusable_answers_are_invalid_and_never_asked_again(tmp_path, fault, structured):
    answer, state, _ = ask_one(tmp_path, EndpointOptions(fault=fault), structured=structured)
    assert answer.status == "invalid_response" and answer.error_kind == "invalid_response"
    assert answer.subgoal is None and state.counter == 1
    receipt = answer.receipt
    assert receipt.status == "invalid_response" and receipt.subgoals == {answer.request_id: None}
    assert receipt.response_sha256 and receipt.usage.input_tokens  # the call happened and is accounted


def test_overlong_subgoal_is_rejected_not_trimmed(tmp_path):
    answer, _, _ = ask_one(tmp_path, EndpointOptions(fault="overlong_subgoal", overlong_chars=200), max_subgoal_chars=100)
    assert answer.status == "invalid_response" and "more than 100" in answer.error


def test_latency_beyond_the_deadline_is_a_timeout(tmp_path):
    # The endpoint would answer after 5 s: a client that waited for it would get "ok", not a timeout.
    answer, _, receipts = ask_one(tmp_path, EndpointOptions(latency_s=5.0), deadline_s=0.4)
    assert answer.status == "timeout" and answer.error_kind == "timeout" and answer.subgoal is None
    assert [(r.kind, r.status) for r in receipts] == [
        ("attempt_started", "started"), ("attempt", "timeout"), ("outcome", "timeout")
    ]


# ---- answers: parsing and matching (pure) --------------------------------------------


def test_plain_text_answers_accept_json_or_subgoal_lines():
    tokens = {"r1": "t1"}
    for text in [
        'Here you go: {"request_id": "r1", "token": "t1", "subgoal": "  grasp the cup  "}',
        '```json\n{"answers": [{"request_id": "r1", "token": "t1", "subgoal": "grasp the cup"}]}\n```',
        "REQUEST_ID: r1\nTOKEN: t1\nSUBGOAL: grasp the cup",
    ]:
        assert check_answers(parse_answers(text, structured=False), tokens, 50) == ({"r1": "grasp the cup"}, {})
    two = parse_answers("REQUEST_ID: r1\nTOKEN: t1\nSUBGOAL: grasp the cup\nSUBGOAL: open the drawer", False)
    subgoals, errors = check_answers(two, tokens, 50)
    assert subgoals == {"r1": None} and "2 answers" in errors["r1"]
    _, errors = check_answers(parse_answers("REQUEST_ID: r1\nTOKEN: t2\nSUBGOAL: x", False), tokens, 50)
    assert "token" in errors["r1"]


def test_request_rejects_missing_or_extra_views():
    views = make_request(0).views
    with pytest.raises(ValueError):
        SubgoalRequest("c", "open the drawer", 10, {k: v for k, v in views.items() if k != "frontview"})
    with pytest.raises(ValueError):
        SubgoalRequest("c", "open the drawer", 10, views | {"sideview": views["agentview"]})
    with pytest.raises(ValueError):
        SubgoalRequest("c", "open the drawer", 10, views | {"agentview": views["agentview"].astype(np.float32)})


# ---- batching -----------------------------------------------------------------------


def test_batch_of_eight_matches_every_subgoal_to_its_case(tmp_path):
    requests = [make_request(i, text) for i, (text, _) in enumerate(CASES)]
    answers, state = run(ask_all(EndpointOptions(), tmp_path / "r.jsonl", requests, batch_size=8, batch_window_s=5.0))
    assert state.counter == 1 and state.requests[0].n_images == 1  # one call, one contact sheet
    for answer, (_, obj) in zip(answers, CASES):
        # Each subgoal names its own case's object (the subgoal model or, outside its tasks, the rule).
        assert answer.status == "ok" and f"the {obj}" in answer.subgoal
    receipts = read_receipts(tmp_path / "r.jsonl")
    outcomes = [r for r in receipts if r.kind == "outcome"]
    assert len(outcomes) == 1
    outcome = outcomes[0]
    assert outcome.case_ids == [r.case_id for r in requests]
    assert outcome.request_ids == [a.request_id for a in answers] and len(outcome.tokens) == 8
    assert len(outcome.sent_image_sha256) == 1 and all(len(v) == 3 for v in outcome.image_sha256.values())
    summary = usage_summary(receipts)
    assert summary.calls == 1 and summary.cases == 8 and summary.by_status == {"ok": 1}
    assert summary.tokens["input"].total == outcome.usage.input_tokens


def test_batch_rows_follow_the_contact_sheet(tmp_path):
    # Only row 2 is blank; the endpoint must cut the sheet so exactly that case says so.
    requests = [make_request(i, CASES[i][0], blank=(i == 2)) for i in range(4)]
    answers, _ = run(ask_all(EndpointOptions(), tmp_path / "r.jsonl", requests, batch_size=4, batch_window_s=5.0))
    assert [a.subgoal == "look around: the view is empty" for a in answers] == [False, False, True, False]


def test_wrong_request_id_in_a_batch_spoils_only_that_case(tmp_path):
    requests = [make_request(i, text) for i, (text, _) in enumerate(CASES)]
    answers, _ = run(
        ask_all(EndpointOptions(fault="wrong_request_id"), tmp_path / "r.jsonl", requests, batch_size=8, api="responses")
    )
    receipt = answers[0].receipt
    bad = [a for a in answers if a.status != "ok"]
    # The endpoint corrupts the answer of the sheet's first row.
    assert [a.request_id for a in bad] == [receipt.request_ids[0]]
    assert bad[0].status == "invalid_response" and bad[0].subgoal is None
    assert receipt.status == "ok" and receipt.request_status[receipt.request_ids[0]] == "invalid_response"
    assert sum(1 for a in answers if a.status == "ok") == 7


def test_a_partial_batch_goes_when_the_window_closes(tmp_path):
    requests = [make_request(i, CASES[i][0]) for i in range(2)]
    started = time.monotonic()
    answers, state = run(ask_all(EndpointOptions(), tmp_path / "r.jsonl", requests, batch_size=8, batch_window_s=0.3))
    assert time.monotonic() - started >= 0.3
    assert state.counter == 1 and all(a.status == "ok" for a in answers)
    assert answers[0].call_id == answers[1].call_id


# ---- prompts ------------------------------------------------------------------------


def test_template_sha256_follows_the_text(tmp_path):
    (tmp_path / "t.txt").write_text("Do {instruction} in {remaining_steps} steps.\n")
    first = load_template("t", tmp_path)
    assert render(first, instruction="it", remaining_steps=3) == "Do it in 3 steps.\n"
    (tmp_path / "t.txt").write_text("Please do {instruction} in {remaining_steps} steps.\n")
    second = load_template("t", tmp_path)
    assert first.sha256 != second.sha256
    shipped = load_template("subgoal_v1")
    rendered = render(shipped, instruction="open the drawer", remaining_steps=40, view_names="a, b, c", max_chars=1500)
    assert "open the drawer" in rendered and "1500" in rendered


def test_receipts_carry_the_template_digest(tmp_path):
    root = tmp_path / "prompts"
    root.mkdir()
    text = (REPO / "prompts" / "subgoal_v1.txt").read_text()
    digests = []
    for variant in (text, text + "\nBe brief.\n"):
        (root / "subgoal_v1.txt").write_text(variant)
        answer, _, _ = ask_one(tmp_path, EndpointOptions(), prompt_root=str(root))
        digests.append((answer.receipt.prompt_template_sha256, answer.receipt.prompt_sha256))
    assert digests[0][0] == load_template("subgoal_v1", root=REPO / "prompts").sha256
    assert digests[0][0] != digests[1][0] and digests[0][1] != digests[1][1]


# ---- secrets ------------------------------------------------------------------------


def test_api_key_never_reaches_receipts_or_logs(tmp_path, monkeypatch, capfd):
    key = "sk-fake-Zq7Xw3distinctive-key-0042"
    monkeypatch.setenv("RESCUE_TEST_VLM_KEY", key)
    with capture_logs() as events:
        ok, state, _ = ask_one(tmp_path, EndpointOptions(expected_api_key=key), api_key_env="RESCUE_TEST_VLM_KEY")
        # A provider that echoes a wrong key in its error must not get it into a receipt either.
        bad, _, _ = ask_one(tmp_path, EndpointOptions(expected_api_key="other"), api_key_env="RESCUE_TEST_VLM_KEY")
    assert ok.status == "ok" and state.requests[0].key_matched is True
    assert bad.status == "broker_error" and bad.error_kind == "auth" and "[redacted]" in bad.error
    assert any(e["event"] == "vlm.call" for e in events) and key not in repr(events)
    structlog.get_logger().info("vlm.call", probe=True)  # the default renderer, too
    out, err = capfd.readouterr()
    assert key not in out + err
    assert key not in (tmp_path / "r.jsonl").read_text()
    assert key not in repr(VLMConfig(base_url="http://x", api_key=key))


# ---- durability ---------------------------------------------------------------------


def _asking_child(receipts, kill_after_answer: bool) -> str:
    """A script that asks the VLM at argv[1] once (receipts to `receipts`), then SIGKILLs itself if asked to."""
    kill = "os.kill(os.getpid(), signal.SIGKILL)" if kill_after_answer else "pass"
    return textwrap.dedent(
        f"""
        import asyncio, os, signal, sys
        import numpy as np
        from rescue.core.configuration.vlm_config import VLMConfig
        from rescue.core.images import VLM_VIEWS
        from rescue.vlm.answers import SubgoalRequest
        from rescue.vlm.client import VLMClient
        from rescue.study.receipts import ReceiptLog

        async def main():
            views = {{n: np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8) for n in VLM_VIEWS}}
            client = VLMClient(VLMConfig(base_url=sys.argv[1]), ReceiptLog({str(receipts)!r}))
            await client.ask(SubgoalRequest("case-kill", "put the cream cheese in the bowl", 100, views))
            {kill}

        asyncio.run(main())
        """
    )


def test_outcome_receipt_is_on_disk_when_ask_returns(tmp_path):
    receipts = tmp_path / "receipts.jsonl"
    child = _asking_child(receipts, kill_after_answer=True)

    async def go():
        runner, base_url = await start_endpoint(EndpointOptions())
        try:
            env = os.environ | {"PYTHONPATH": str(REPO)}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", child, base_url, env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )
            _, err = await asyncio.wait_for(proc.communicate(), HANG_S)
            return proc.returncode, err.decode()
        finally:
            await runner.cleanup()

    returncode, err = run(go())
    assert returncode == -signal.SIGKILL, err
    outcomes = [r for r in read_receipts(receipts) if r.kind == "outcome"]
    assert len(outcomes) == 1 and outcomes[0].case_ids == ["case-kill"] and outcomes[0].status == "ok"
    assert next(iter(outcomes[0].subgoals.values())) == "grasp the cream cheese again, then place it in the bowl"


def test_truncated_last_line_is_ignored_and_reported(tmp_path):
    path = tmp_path / "r.jsonl"
    answer, _, _ = ask_one(tmp_path, EndpointOptions())
    with open(path, "a") as f:
        f.write(answer.receipt.model_dump_json()[:57])
    scan = scan_receipts(path)
    assert len(scan.receipts) == 3 and scan.truncated_tail is not None
    with capture_logs() as events:
        assert read_receipts(path) == scan.receipts
    assert [e["event"] for e in events] == ["receipts.truncated_tail"]


# ---- usage summary (pure) -----------------------------------------------------------


def _receipt(call_id: str, kind: str, status: str, latency: float, usage: Usage) -> Receipt:
    return Receipt(
        kind=kind, call_id=call_id, attempt=1, request_ids=[call_id], case_ids=[call_id], model_requested="m",
        endpoint_kind="chat", prompt_template="t", prompt_template_sha256="0", prompt_sha256="0",
        started_at=0.0, finished_at=latency, latency_s=latency, status=status, usage=usage,
    )


def test_usage_summary_keeps_unknown_counts_unknown():
    full = Usage(input_tokens=100, cached_input_tokens=0, output_tokens=10, reasoning_tokens=4)
    receipts = [
        _receipt("a", "attempt", "error", 0.5, Usage()),
        _receipt("a", "outcome", "ok", 2.0, full),
        _receipt("a", "outcome", "ok", 2.0, full),  # the same call read twice
        _receipt("b", "outcome", "ok", 4.0, Usage(input_tokens=50, output_tokens=5)),
        _receipt("c", "outcome", "error", 1.0, Usage()),  # a quota error reports nothing
    ]
    s = usage_summary(receipts)
    assert s.calls == 3 and s.by_status == {"ok": 2, "error": 1} and s.cost is None
    assert s.tokens["input"].model_dump() == {"known_sum": 150, "calls_with": 2, "calls_without": 1, "total": None}
    assert s.tokens["reasoning"].known_sum == 4 and s.tokens["reasoning"].calls_with == 1
    assert (s.latency.sum_s, s.latency.median_s, s.latency.min_s, s.latency.max_s) == (7.0, 2.0, 1.0, 4.0)
    only_ok = usage_summary(receipts[:4])
    assert only_ok.tokens["input"].total == 150 and only_ok.tokens["cached_input"].total is None


def test_usage_summary_of_nothing():
    s = usage_summary([])
    assert s.calls == 0 and s.latency.mean_s is None and s.tokens["input"].total == 0


def test_receipt_lines_are_plain_json(tmp_path):
    answer, _, _ = ask_one(tmp_path, EndpointOptions())
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["call_id"] == answer.call_id


def test_a_cancelled_ask_still_leaves_an_outcome(tmp_path):
    async def go():
        runner, base_url = await start_endpoint(EndpointOptions(latency_s=5.0))
        client = VLMClient(VLMConfig(base_url=base_url, **FAST), ReceiptLog(tmp_path / "r.jsonl"))
        task = asyncio.create_task(client.ask(make_request(0)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.aclose()
        await runner.cleanup()

    run(go())
    outcome = read_receipts(tmp_path / "r.jsonl")[-1]
    assert outcome.kind == "outcome" and outcome.status == "error" and outcome.error_kind == "cancelled"


def test_serve_vlm_runs_until_sigterm():
    import openai

    code = "import sys; from rescue.cli import main; sys.exit(main(['serve-vlm', '--port', '0']))"
    env = os.environ | {"PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        base_url = proc.stdout.readline().split(" at ")[1].split()[0]
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=HANG_S)
        assert [m.id for m in client.models.list()] == ["rescue-advisor-v0"]
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(HANG_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- receipt references and the one reader -----------------------------------------


def _line_bytes(path: Path, lineno: int) -> bytes:
    return path.read_bytes().split(b"\n")[lineno - 1]


def test_answer_carries_the_reference_of_its_outcome_line(tmp_path):
    study = tmp_path / "study"

    async def go():
        runner, base_url = await start_endpoint(EndpointOptions(fault="server_error", fault_count=1))
        log = ReceiptLog(study / "receipts" / "receipts.jsonl", name="receipts/receipts.jsonl")
        client = VLMClient(VLMConfig(base_url=base_url, **FAST), log)
        try:
            return await client.ask(make_request(0))
        finally:
            await client.aclose()
            await runner.cleanup()

    answer = run(go())
    path = study / "receipts" / "receipts.jsonl"
    ref = answer.receipt_ref
    # Two attempts (started, ended) and then the outcome on line 5.
    assert ref.path == "receipts/receipts.jsonl" and ref.lineno == 5
    raw = _line_bytes(path, ref.lineno)
    assert ref.sha256 == hashlib.sha256(raw).hexdigest() and Receipt.model_validate_json(raw) == answer.receipt
    lines = read_receipt_file(path)
    chosen = outcomes_by_call(lines)[answer.call_id]
    assert chosen.ref(ref.path) == ref and chosen.receipt == answer.receipt
    outcome = answer.receipt
    assert [r.lineno for r in outcome.attempt_refs] == [1, 2, 3, 4]
    assert [lines[r.lineno - 1].receipt.kind for r in outcome.attempt_refs] == ["attempt_started", "attempt"] * 2
    assert check_attempt_refs(outcome, lines) == []
    # Editing an attempt line, or deleting one, is seen from the outcome line's references.
    edited = path.read_bytes().replace(b'"error_kind":"server"', b'"error_kind":"client"', 1)
    path.write_bytes(edited)
    assert any("line 2 changed" in p for p in check_attempt_refs(outcome, read_receipt_file(path)))
    kept = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join(kept[2:]))
    problems = check_attempt_refs(outcome, read_receipt_file(path))
    assert problems and any("changed" in p or "no line" in p for p in problems)


def _outcome(call_id: str, status: str, case: str = "case-0") -> Receipt:
    return Receipt(
        kind="outcome", call_id=call_id, attempt=1, request_ids=["r"], case_ids=[case], model_requested="m",
        endpoint_kind="chat", prompt_template="t", prompt_template_sha256="0", prompt_sha256="0",
        started_at=0.0, finished_at=1.0, latency_s=1.0, status=status,
        usage=Usage(input_tokens=10 if status == "ok" else 99),
    )


def test_a_call_with_two_outcome_lines_is_its_first_one_for_every_reader(tmp_path):
    path = tmp_path / "receipts.jsonl"
    log = ReceiptLog(path, name="receipts.jsonl")
    first = log.write(_outcome("call-a", "ok"))
    log.write(_outcome("call-b", "ok", "case-1"))
    second = log.write(_outcome("call-a", "error"))  # an anomaly: a second outcome for call-a
    log.close()
    assert (first.lineno, second.lineno) == (1, 3)
    lines = read_receipt_file(path)
    # The reader's rule: the first outcome line is the call's outcome.
    assert outcomes_by_call(lines)["call-a"].ref("receipts.jsonl") == first
    assert [line.ref("receipts.jsonl") for line in extra_outcomes(lines)["call-a"]] == [second]
    assert first_outcomes(read_receipts(path))["call-a"].status == "ok"
    # Usage agrees, from lines or from receipts.
    for source in (lines, read_receipts(path)):
        summary = usage_summary(source)
        assert summary.calls == 2 and summary.by_status == {"ok": 2} and summary.tokens["input"].total == 20
    assert check_ref(first, lines) is None and check_ref(second, lines) is None


def test_line_numbers_hold_across_writers_and_after_a_cut_line(tmp_path):
    path = tmp_path / "r.jsonl"
    a, b = ReceiptLog(path), ReceiptLog(path)
    refs = [a.write(_outcome("c1", "ok")), b.write(_outcome("c2", "ok")), a.write(_outcome("c3", "ok"))]
    with open(path, "ab") as f:
        f.write(_outcome("cut", "ok").model_dump_json().encode()[:40])  # a crash mid-write
    refs.append(b.write(_outcome("c4", "ok")))
    lines = read_receipt_file(path)
    assert [r.lineno for r in refs] == [1, 2, 3, 5]
    assert all(check_ref(r, lines) is None for r in refs)
    cut = [line for line in lines if line.receipt is None]
    assert len(cut) == 1 and cut[0].lineno == 4 and cut[0].complete  # the cut line stays its own line
    assert [line.receipt.call_id for line in lines if line.receipt] == ["c1", "c2", "c3", "c4"]


def test_a_kill_during_an_attempt_leaves_its_started_line(tmp_path):
    receipts = tmp_path / "receipts.jsonl"
    child = _asking_child(receipts, kill_after_answer=False)

    async def go():
        runner, base_url = await start_endpoint(EndpointOptions(latency_s=30.0))
        try:
            env = os.environ | {"PYTHONPATH": str(REPO)}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", child, base_url, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            state = endpoint_state(runner)
            deadline = time.monotonic() + HANG_S  # the child's start is slow on a busy machine, not this slow
            while not state.counter and time.monotonic() < deadline and proc.returncode is None:
                await asyncio.sleep(0.05)  # until the request reaches the endpoint: the attempt is in flight
            proc.kill()
            await proc.wait()
            return state.counter, proc.returncode
        finally:
            await runner.cleanup()

    counter, returncode = run(go())
    assert counter == 1 and returncode == -signal.SIGKILL
    lines = read_receipt_file(receipts)
    assert [(line.receipt.kind, line.receipt.status, line.receipt.attempt) for line in lines] == [
        ("attempt_started", "started", 1)
    ]
    assert lines[0].receipt.case_ids == ["case-kill"] and lines[0].receipt.finished_at is None
    assert unfinished_calls(lines) == {lines[0].receipt.call_id: lines} and outcomes_by_call(lines) == {}


# ---- generation settings ------------------------------------------------------------


@pytest.mark.parametrize(
    "api, sent",
    [
        ("chat", {"max_completion_tokens": 256, "temperature": 0.2, "seed": 7, "reasoning_effort": "low", "store": False}),
        ("responses", {"max_output_tokens": 256, "temperature": 0.2, "reasoning": {"effort": "low"}, "store": False}),
    ],
)
def test_generation_settings_reach_the_endpoint_and_every_receipt(tmp_path, api, sent):
    settings = dict(max_output_tokens=256, temperature=0.2, reasoning_effort="low")
    if api == "chat":
        settings["seed"] = 7
    answer, state, receipts = ask_one(tmp_path, EndpointOptions(), api=api, **settings)
    assert answer.status == "ok" and state.requests[0].generation == sent
    recorded = {"max_output_tokens": 256, "temperature": 0.2, "seed": settings.get("seed"), "reasoning_effort": "low", "store": False}
    assert len(receipts) == 3 and all(r.generation == recorded for r in receipts)
    # The receipt names the fields as they went on the wire, exactly what the endpoint received.
    assert all(r.sent_generation == sent for r in receipts)


def test_unset_generation_settings_are_not_sent_and_store_is_off(tmp_path):
    answer, state, _ = ask_one(tmp_path / "a", EndpointOptions())
    assert state.requests[0].generation == {"store": False} == answer.receipt.sent_generation
    assert answer.receipt.generation == {
        "max_output_tokens": None, "temperature": None, "seed": None, "reasoning_effort": None, "store": False
    }
    _, state, _ = ask_one(tmp_path / "b", EndpointOptions(), api="responses", store=True)
    assert state.requests[0].generation == {"store": True}


def test_a_seed_the_responses_api_cannot_take_is_refused():
    with pytest.raises(ValueError, match="Responses API has no seed"):
        VLMConfig(base_url="http://x", api="responses", seed=3)
    with pytest.raises(ValueError):
        VLMConfig(base_url="http://x", modle="typo")  # unknown keys are refused


# ---- what a call saw ----------------------------------------------------------------


def test_images_prompt_and_response_are_kept_by_sha256(tmp_path):
    artifacts = tmp_path / "vlm"
    request = make_request(3)

    async def go():
        runner, base_url = await start_endpoint(EndpointOptions())
        client = VLMClient(VLMConfig(base_url=base_url, **FAST), ReceiptLog(tmp_path / "r.jsonl"), artifacts)
        try:
            return await client.ask(request)
        finally:
            await client.aclose()
            await runner.cleanup()

    answer = run(go())
    outcome = answer.receipt
    assert len(outcome.sent_image_sha256) == 3
    for name, sha in zip(VLM_VIEWS, outcome.sent_image_sha256):
        png = artifacts / f"{sha}.png"
        assert hashlib.sha256(png.read_bytes()).hexdigest() == sha
        assert np.array_equal(np.asarray(Image.open(png)), request.views[name])  # the exact pixels sent
    prompt = (artifacts / f"{outcome.prompt_sha256}.txt").read_text("utf-8")
    assert answer.request_id in prompt and request.instruction in prompt
    body = json.loads((artifacts / f"{outcome.response_sha256}.txt").read_text("utf-8"))
    assert json.loads(body["choices"][0]["message"]["content"])["answers"][0]["subgoal"] == answer.subgoal
    assert sorted(p.name for p in artifacts.iterdir()) == sorted(
        [f"{s}.png" for s in outcome.sent_image_sha256] + [f"{outcome.prompt_sha256}.txt", f"{outcome.response_sha256}.txt"]
    )
    assert check_artifacts(outcome, artifacts) == []
    png = artifacts / f"{outcome.sent_image_sha256[1]}.png"
    png.write_bytes(png.read_bytes() + b"\0")
    (artifacts / f"{outcome.response_sha256}.txt").unlink()
    problems = check_artifacts(outcome, artifacts)
    assert len(problems) == 2
    assert any("does not hash" in p and png.name in p for p in problems)
    assert any("raw response" in p and "missing" in p for p in problems)


def test_a_batch_keeps_its_contact_sheet(tmp_path):
    artifacts = tmp_path / "vlm"

    async def go():
        runner, base_url = await start_endpoint(EndpointOptions())
        config = VLMConfig(base_url=base_url, batch_size=2, batch_window_s=5.0, **FAST)
        client = VLMClient(config, ReceiptLog(tmp_path / "r.jsonl"), artifacts)
        try:
            return await asyncio.gather(*(client.ask(make_request(i, CASES[i][0])) for i in range(2)))
        finally:
            await client.aclose()
            await runner.cleanup()

    answers = run(go())
    outcome = answers[0].receipt
    (sheet,) = outcome.sent_image_sha256
    assert np.asarray(Image.open(artifacts / f"{sheet}.png")).shape == (64, 96, 3)  # 2 rows of 3 views
    assert check_artifacts(outcome, artifacts) == []


# ---- refusals -----------------------------------------------------------------------


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_refusal_is_recorded_as_a_refusal(tmp_path, api):
    answer, state, receipts = ask_one(tmp_path, EndpointOptions(fault="refusal"), api=api)
    assert state.counter == 1  # an answer arrived: never asked again
    assert answer.status == "invalid_response" and answer.error_kind == "refusal" and answer.subgoal is None
    assert "can't help" in answer.error
    outcome = answer.receipt
    assert outcome.status == "refusal" and outcome.error_kind == "refusal" and outcome.response_sha256
    assert receipts[1].kind == "attempt" and receipts[1].status == "ok"


# ---- the key from the config --------------------------------------------------------


def test_a_configured_key_is_sent_but_never_written(tmp_path, monkeypatch):
    from rescue.core.configuration.config import StudyConfig

    key = "sk-cfg-Kq81distinctive-config-key"
    monkeypatch.delenv("RESCUE_TEST_VLM_KEY", raising=False)
    answer, state, _ = ask_one(
        tmp_path, EndpointOptions(expected_api_key=key), api_key=key, api_key_env="RESCUE_TEST_VLM_KEY",
        prompt_root=None,
    )
    assert answer.status == "ok" and state.requests[0].key_matched is True
    assert key not in (tmp_path / "r.jsonl").read_text()
    study_config = StudyConfig.model_validate({"vlm": {"base_url": "http://x", "api_key": key, "api_key_env": "RESCUE_TEST_VLM_KEY"}})
    dumped = study_config.model_dump_json()
    assert key not in dumped and "*****" not in dumped and '"api_key"' not in dumped
    # What a resumed study loads: no key, and a clear way to give it again.
    resumed = StudyConfig.model_validate_json(dumped).vlm
    assert resumed.api_key is None and resumed.api_key_from_config
    with pytest.raises(MissingAPIKey, match="RESCUE_TEST_VLM_KEY"):
        VLMClient(resumed, ReceiptLog(tmp_path / "r2.jsonl"))
    monkeypatch.setenv("RESCUE_TEST_VLM_KEY", key)
    assert resumed.missing_key_message() is None and resumed.resolved_api_key() == key
    # A mask written by an older version is never sent as a key.
    legacy = VLMConfig.model_validate({"base_url": "http://x", "api_key": "**********", "api_key_env": "RESCUE_TEST_VLM_KEY"})
    assert legacy.resolved_api_key() == key


# ---- the local endpoint as any VLM --------------------------------------------------


def test_the_endpoint_answers_a_free_form_question_over_both_apis():
    import openai

    def url(pixels: np.ndarray) -> str:
        return "data:image/png;base64," + base64.b64encode(encode_png(pixels)).decode()

    question = "The robot was told to pick up the ketchup and place it in the basket. It has 40 steps left. What should it do next?"
    noise = np.random.default_rng(5).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    blank = np.full((64, 64, 3), 90, np.uint8)

    async def go():
        runner, base_url = await start_endpoint(EndpointOptions())
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=HANG_S)
        try:
            chat = await client.chat.completions.create(
                model="rescue-advisor-v0",
                messages=[{"role": "user", "content": [
                    {"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": url(noise)}},
                ]}],
            )
            resp = await client.responses.create(
                model="rescue-advisor-v0",
                input=[{"role": "user", "content": [
                    {"type": "input_text", "text": question}, {"type": "input_image", "image_url": url(noise)},
                ]}],
            )
            empty = await client.chat.completions.create(
                model="rescue-advisor-v0",
                messages=[{"role": "user", "content": [
                    {"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": url(blank)}},
                ]}],
            )
            three = await client.chat.completions.create(
                model="rescue-advisor-v0",
                messages=[{"role": "user", "content": [{"type": "text", "text": question}]
                           + [{"type": "image_url", "image_url": {"url": url(noise)}}] * 3}],
            )
            return chat, resp, empty, three, endpoint_state(runner)
        finally:
            await client.close()
            await runner.cleanup()

    chat, resp, empty, three, state = run(go())
    # One view: the instruction's wording, hurried by the budget the question states.
    assert chat.choices[0].message.content == "grasp the ketchup again quickly, then place it in the basket"
    assert resp.output_text == chat.choices[0].message.content
    # The decision comes from the image: an empty view says so.
    assert empty.choices[0].message.content == "look around: the view is empty"
    # Three views go to the subgoal model, which names the question's object.
    assert "the ketchup" in three.choices[0].message.content and "{" not in three.choices[0].message.content
    assert all(r.free_form and r.request_ids == [] for r in state.requests)


# ---- one limiter for the study's requests ----------------------------------------------


def _most_at_once(receipts) -> int:
    """The largest number of requests that were in flight together, from the attempt receipts."""
    spans = [(r.started_at, r.finished_at) for r in receipts if r.kind == "attempt"]
    return max(sum(1 for s, f in spans if s <= start < f) for start, _ in spans)


@pytest.mark.parametrize("limit", [None, 2])
def test_concurrent_requests_are_capped_by_max_concurrent_calls(tmp_path, limit):
    requests = [make_request(i) for i in range(6)]
    answers, _ = run(ask_all(EndpointOptions(latency_s=0.3), tmp_path / "r.jsonl", requests, max_concurrent_calls=limit))
    assert all(a.status == "ok" for a in answers)
    # Without a limit all six overlap (so the count below can see a cap); with it, never more than two.
    assert _most_at_once(read_receipts(tmp_path / "r.jsonl")) == (limit or 6)


def test_requests_start_evenly_spaced_at_requests_per_minute(tmp_path):
    requests = [make_request(i) for i in range(5)]
    answers, _ = run(ask_all(EndpointOptions(), tmp_path / "r.jsonl", requests, requests_per_minute=300))
    assert all(a.status == "ok" for a in answers)
    starts = sorted(r.started_at for r in read_receipts(tmp_path / "r.jsonl") if r.kind == "attempt_started")
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(gaps) == 4 and min(gaps) >= 0.19, gaps  # 60 / 300 = 0.2 s apart (clock granularity aside)
