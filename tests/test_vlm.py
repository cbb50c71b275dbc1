"""The VLM client against a real local endpoint, through the real `openai` SDK over loopback."""

from __future__ import annotations

import asyncio
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
from structlog.testing import capture_logs

from rescue.prompts import load_template, render
from rescue.records import Receipt, Usage
from rescue.vlm.client import (
    VIEW_NAMES,
    SubgoalRequest,
    VLMClient,
    VLMConfig,
    check_answers,
    parse_answers,
)
from rescue.vlm.endpoint import EndpointOptions, endpoint_state, start_endpoint
from rescue.vlm.receipts import ReceiptLog, read_receipts, scan_receipts
from rescue.vlm.usage import usage_summary

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent
FAST = dict(backoff_initial_s=0.01, backoff_max_s=0.05, backoff_jitter_s=0.01, request_timeout_s=10.0)

CASES = [
    ("pick up the black bowl between the plate and the ramekin and place it on the plate", "black bowl between the plate and the ramekin"),
    ("put the cream cheese in the bowl", "cream cheese"),
    ("put the wine bottle on top of the cabinet", "wine bottle"),
    ("pick up the ketchup and place it in the basket", "ketchup"),
    ("place the yellow mug on the left plate", "yellow mug"),
    ("pick up the alphabet soup and place it in the basket", "alphabet soup"),
    ("put the moka pot on the stove", "moka pot"),
    ("pick up the salad dressing and place it in the basket", "salad dressing"),
]


def make_request(i: int, instruction: str = CASES[0][0], blank: bool = False) -> SubgoalRequest:
    rng = np.random.default_rng(i)
    views = {
        n: np.full((32, 32, 3), 128, np.uint8) if blank else rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        for n in VIEW_NAMES
    }
    return SubgoalRequest(case_id=f"case-{i}", instruction=instruction, remaining_steps=120, views=views)


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
    assert [r.kind for r in receipts] == ["attempt", "outcome"] and outcome == answer.receipt
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


def test_missing_usage_details_stay_unknown(tmp_path):
    answer, _, _ = ask_one(tmp_path, EndpointOptions(usage_details=False))
    usage = answer.receipt.usage
    assert usage.input_tokens and usage.output_tokens
    assert usage.cached_input_tokens is None and usage.reasoning_tokens is None


def test_models_route_answers_the_sdk():
    import openai

    async def go():
        runner, base_url = await start_endpoint(EndpointOptions())
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        try:
            return [m.id async for m in client.models.list()]
        finally:
            await client.close()
            await runner.cleanup()

    assert run(go()) == ["rescue-advisor-v0"]


# ---- infrastructure faults: retried -------------------------------------------------


def test_rate_limit_is_retried_after_the_retry_after_header(tmp_path):
    started = time.monotonic()
    answer, state, receipts = ask_one(tmp_path, EndpointOptions(fault="rate_limit", fault_count=1, retry_after_s=1))
    assert answer.status == "ok" and answer.receipt.attempt == 2 and state.counter == 2
    # The backoff alone would wait ~0.02 s; only the header explains a full second.
    assert time.monotonic() - started >= 1.0
    first = receipts[0]
    assert first.kind == "attempt" and first.status == "error" and first.error_kind == "rate_limit"
    assert first.provider_request_id and first.provider_request_id != answer.receipt.provider_request_id


def test_server_error_is_retried(tmp_path):
    answer, state, receipts = ask_one(tmp_path, EndpointOptions(fault="server_error", fault_count=2))
    assert answer.status == "ok" and answer.receipt.attempt == 3 and state.counter == 3
    assert [r.error_kind for r in receipts if r.kind == "attempt"] == ["server", "server", None]


def test_dropped_connection_is_retried(tmp_path):
    answer, state, receipts = ask_one(tmp_path, EndpointOptions(fault="drop", fault_count=1))
    assert answer.status == "ok" and answer.receipt.attempt == 2 and state.requests[0].outcome == "dropped"
    assert receipts[0].error_kind == "connection"


def test_retries_end_at_max_attempts(tmp_path):
    answer, state, receipts = ask_one(
        tmp_path, EndpointOptions(fault="server_error", fault_count=99), max_attempts=3
    )
    assert answer.status == "broker_error" and answer.error_kind == "server" and answer.subgoal is None
    assert state.counter == 3 and answer.receipt.attempt == 3 and answer.receipt.status == "error"
    assert [r.kind for r in receipts] == ["attempt"] * 3 + ["outcome"]


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
    started = time.monotonic()
    answer, _, receipts = ask_one(tmp_path, EndpointOptions(latency_s=5.0), deadline_s=0.4)
    assert time.monotonic() - started < 2.0
    assert answer.status == "timeout" and answer.error_kind == "timeout" and answer.subgoal is None
    assert [(r.kind, r.status) for r in receipts] == [("attempt", "timeout"), ("outcome", "timeout")]


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
    assert bad.status == "broker_error" and bad.error_kind == "client" and "[redacted]" in bad.error
    assert any(e["event"] == "vlm.call" for e in events) and key not in repr(events)
    structlog.get_logger().info("vlm.call", probe=True)  # the default renderer, too
    out, err = capfd.readouterr()
    assert key not in out + err
    assert key not in (tmp_path / "r.jsonl").read_text()
    assert key not in repr(VLMConfig(base_url="http://x", api_key=key))


# ---- durability ---------------------------------------------------------------------


def test_outcome_receipt_is_on_disk_when_ask_returns(tmp_path):
    receipts = tmp_path / "receipts.jsonl"
    child = textwrap.dedent(
        f"""
        import asyncio, os, signal, sys
        import numpy as np
        from rescue.vlm.client import VIEW_NAMES, SubgoalRequest, VLMClient, VLMConfig
        from rescue.vlm.receipts import ReceiptLog

        async def main():
            views = {{n: np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8) for n in VIEW_NAMES}}
            client = VLMClient(VLMConfig(base_url=sys.argv[1]), ReceiptLog({str(receipts)!r}))
            await client.ask(SubgoalRequest("case-kill", "put the cream cheese in the bowl", 100, views))
            os.kill(os.getpid(), signal.SIGKILL)

        asyncio.run(main())
        """
    )

    async def go():
        runner, base_url = await start_endpoint(EndpointOptions())
        try:
            env = os.environ | {"PYTHONPATH": str(REPO)}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", child, base_url, env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )
            _, err = await asyncio.wait_for(proc.communicate(), 30)
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
    assert len(scan.receipts) == 2 and scan.truncated_tail is not None
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

    code = "import sys; from rescue.vlm.endpoint import serve_main; sys.exit(serve_main(['--port', '0']))"
    env = os.environ | {"PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        base_url = proc.stdout.readline().split(" at ")[1].split()[0]
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
        assert [m.id for m in client.models.list()] == ["rescue-advisor-v0"]
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
