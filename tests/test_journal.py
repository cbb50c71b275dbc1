"""The journal against a real SQLite file: claims, finality, duplicates, other processes."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import HANG_S

from rescue.core.manifest import Case
from rescue.core.records import ArmResult, Assistance
from rescue.core.verdicts import Verdict
from rescue.study.journal import DuplicateRecord, Journal, JournalError, journal_path

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[1]


def make_cases(n: int, **changes) -> list[Case]:
    return [
        Case(
            case_id=f"case-{i:05d}",
            suite="libero_spatial",
            task_id=i % 10,
            init_state_index=i,
            env_seed=i,
            horizon=220,
            **changes,
        )
        for i in range(n)
    ]


def arm(case_id: str, name: str = "control") -> ArmResult:
    status = "control" if name == "control" else "applied"
    return ArmResult(
        case_id=case_id, arm=name, status="complete", success=False, steps=220,
        assistance=Assistance(status=status),
    )


def verdict(case_id: str, label: str = "not_rescued", rule: int = 8) -> Verdict:
    return Verdict(case_id=case_id, label=label, rule=rule, reason="test")


def interrupt_all(journal: Journal, reason: str = "interrupted") -> list[str]:
    """What a recovery does: every unsettled case interrupted with an unknown verdict, one by one."""
    ids = journal.unsettled_ids()
    for case_id in ids:
        journal.interrupt(case_id, verdict(case_id, "unknown", 2), reason)
    return ids


@pytest.fixture
def study(tmp_path):
    return tmp_path / "study"


@pytest.fixture
def journal(study):
    j = Journal.create(study, make_cases(5), {"manifest_sha256": "ab12"})
    yield j
    j.close()


def run_python(code: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True, **kwargs
    )


# --- creating and opening ----------------------------------------------------


def test_create_then_open_round_trips_cases_and_meta(journal, study):
    assert journal.path == journal_path(study)
    with Journal.open(study) as again:
        assert again.cases() == make_cases(5)
        assert again.case("case-00002") == make_cases(5)[2]
        assert again.meta()["manifest_sha256"] == "ab12"
        assert again.counts() == {"pending": 5, "claimed": 0, "finished": 0, "interrupted": 0}
        assert again.pending_ids() == [c.case_id for c in make_cases(5)]
    conn = sqlite3.connect(journal_path(study))
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_create_refuses_an_existing_journal(journal, study):
    with pytest.raises(JournalError, match="already exists"):
        Journal.create(study, make_cases(2), {})
    assert journal.counts()["pending"] == 5


def test_create_with_duplicate_ids_leaves_nothing_behind(study):
    cases = make_cases(3) + make_cases(1)
    with pytest.raises(JournalError):
        Journal.create(study, cases, {})
    assert list(study.iterdir()) == []


def test_open_without_a_journal_fails_and_creates_nothing(study):
    study.mkdir()
    with pytest.raises(JournalError, match="no journal"):
        Journal.open(study)
    assert list(study.iterdir()) == []


def test_unknown_case_raises_key_error(journal):
    with pytest.raises(KeyError):
        journal.case("nope")
    with pytest.raises(KeyError):
        journal.state("nope")
    with pytest.raises(KeyError):
        journal.claim("nope", "w")


def test_twenty_thousand_cases_ingest(study):
    cases = make_cases(20_000)
    with Journal.create(study, cases, {}) as j:
        assert j.counts()["pending"] == 20_000
        assert j.claim_next("w").case_id == "case-00000"
        assert j.cases()[-1] == cases[-1]


def test_adapter_case_type_round_trips(study):
    class KitchenCase(Case):
        layout_id: int

    cases = [KitchenCase(**c.model_dump(), layout_id=3) for c in make_cases(2)]
    with Journal.create(study, cases, {}, case_type=KitchenCase) as j:
        assert j.claim_next("w").layout_id == 3
        assert j.cases() == cases


# --- claims ------------------------------------------------------------------


def test_claim_is_compare_and_set(journal):
    assert journal.claim("case-00001", "w1") is True
    assert journal.claim("case-00001", "w2") is False
    row = next(r for r in journal.rows() if r.case_id == "case-00001")
    assert (row.state, row.worker) == ("claimed", "w1")
    assert row.claimed_at is not None


def test_claim_next_follows_manifest_order_and_skips_claimed(journal):
    assert journal.claim("case-00001", "w")
    got = [journal.claim_next("w").case_id for _ in range(4)]
    assert got == ["case-00000", "case-00002", "case-00003", "case-00004"]
    assert journal.claim_next("w") is None
    assert journal.counts()["pending"] == 0 and journal.counts()["claimed"] == 5


def test_claim_next_prefers_the_tasks_the_simulator_loaded_most_recent_first_then_manifest_order(study):
    # Tasks 0, 1, 2, 0, 1, 2, ...: a simulator that loaded task 2 last, and task 1 before, gets task 2's cases
    # while any is pending, then task 1's, then the rest in manifest order; no case is claimed twice.
    with Journal.create(study, [c.model_copy(update={"task_id": i % 3}) for i, c in enumerate(make_cases(7))],
                        {"manifest_sha256": "ab12"}) as j:
        prefer = [("libero_spatial", 2), ("libero_spatial", 1)]
        got = [j.claim_next("w", prefer=prefer).case_id for _ in range(7)]
        assert got == ["case-00002", "case-00005", "case-00001", "case-00004", "case-00000", "case-00003",
                       "case-00006"]
        assert j.claim_next("w", prefer=prefer) is None
    # Another suite's task of the same number is another task.
    with Journal.create(study.with_name("other"), make_cases(3), {"manifest_sha256": "ab12"}) as j:
        assert j.claim_next("w", prefer=[("libero_object", 2)]).case_id == "case-00000"


def test_concurrent_claim_of_one_case_has_one_winner(journal, study):
    results: list[bool] = []
    barrier = threading.Barrier(8)

    def contend():
        with Journal.open(study) as j:
            barrier.wait()
            results.append(j.claim("case-00003", f"w{threading.get_ident()}"))

    threads = [threading.Thread(target=contend) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True]


def test_threads_with_their_own_journals_never_share_a_case(study):
    Journal.create(study, make_cases(200), {}).close()
    claimed: dict[int, list[str]] = {}
    barrier = threading.Barrier(4)

    def worker(n: int):
        mine = claimed.setdefault(n, [])
        with Journal.open(study) as j:
            barrier.wait()
            while (case := j.claim_next(f"w{n}")) is not None:
                mine.append(case.case_id)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [cid for ids in claimed.values() for cid in ids]
    assert len(everything) == len(set(everything)) == 200
    assert set(everything) == {c.case_id for c in make_cases(200)}
    with Journal.open(study) as j:
        assert j.counts()["claimed"] == 200
        by_worker = {r.case_id: r.worker for r in j.rows()}
        assert all(by_worker[cid] == f"w{n}" for n, ids in claimed.items() for cid in ids)


def test_processes_never_share_a_case(study):
    Journal.create(study, make_cases(200), {}).close()
    code = (
        "import json, sys\n"
        "from rescue.study.journal import Journal\n"
        f"j = Journal.open({str(study)!r})\n"
        "ids = []\n"
        "while (c := j.claim_next(sys.argv[-1] if len(sys.argv) > 1 else 'p')) is not None:\n"
        "    ids.append(c.case_id)\n"
        "print(json.dumps(ids))\n"
    )
    procs = [run_python(code) for _ in range(4)]
    outputs = [json.loads(p.communicate(timeout=HANG_S)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    everything = [cid for ids in outputs for cid in ids]
    assert len(everything) == len(set(everything)) == 200


def test_state_moves_are_enforced_by_the_file_itself(journal):
    journal.claim("case-00000", "w")
    journal.claim("case-00001", "w")
    interrupt_all(journal)
    conn = sqlite3.connect(journal.path)
    for case_id, state in [
        ("case-00000", "pending"),
        ("case-00000", "claimed"),
        ("case-00001", "finished"),
        ("case-00002", "finished"),
    ]:
        with pytest.raises(sqlite3.IntegrityError, match="illegal case state change"):
            conn.execute("UPDATE cases SET state = ? WHERE case_id = ?", (state, case_id))
    conn.close()
    assert [journal.state(f"case-0000{i}") for i in range(3)] == ["interrupted", "interrupted", "pending"]


# --- interruption ------------------------------------------------------------


def test_recover_interrupted_is_final(journal):
    journal.claim("case-00003", "w")
    journal.claim("case-00001", "w")
    journal.claim("case-00002", "w")
    journal.finish_case("case-00002", (), verdict("case-00002"))
    assert interrupt_all(journal) == ["case-00001", "case-00003"]
    assert journal.state("case-00001") == "interrupted"
    assert journal.state("case-00002") == "finished"
    assert interrupt_all(journal) == []
    handed_out = []
    while (case := journal.claim_next("w2")) is not None:
        handed_out.append(case.case_id)
    assert handed_out == ["case-00000", "case-00004"]
    assert journal.claim("case-00001", "w2") is False
    assert journal.counts() == {"pending": 0, "claimed": 2, "finished": 1, "interrupted": 2}
    row = next(r for r in journal.rows() if r.case_id == "case-00001")
    assert row.reason == "interrupted"


def test_killed_worker_leaves_its_case_claimed_then_interrupted(journal, study):
    code = (
        "import sys, time\n"
        "from rescue.study.journal import Journal\n"
        f"j = Journal.open({str(study)!r})\n"
        "case = j.claim_next('doomed')\n"
        "print(case.case_id, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = run_python(code)
    try:
        claimed = proc.stdout.readline().strip()
        assert claimed == "case-00000"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=HANG_S)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL

    with Journal.open(study) as j:
        assert j.state(claimed) == "claimed"
        assert interrupt_all(j, reason="worker killed") == [claimed]
        assert j.state(claimed) == "interrupted"
        assert j.claim_next("next").case_id == "case-00001"
        assert j.verdicts()[claimed].label == "unknown"


# --- results -----------------------------------------------------------------


def test_arm_results_are_written_once(journal):
    journal.claim("case-00000", "w")
    twice = [arm("case-00000", "control"), arm("case-00000", "assisted"),
             arm("case-00000", "control").model_copy(update={"success": True})]
    with pytest.raises(DuplicateRecord):
        journal.finish_case("case-00000", twice, verdict("case-00000"))
    # One transaction: nothing of the refused call is kept, and the case is still claimed.
    assert journal.arms("case-00000") == {} and journal.state("case-00000") == "claimed"
    journal.finish_case("case-00000", twice[:2], verdict("case-00000"))
    arms = journal.arms("case-00000")
    assert set(arms) == {"control", "assisted"}
    assert arms["control"].success is False
    assert journal.all_arms() == {"case-00000": arms}


def test_arm_results_need_a_live_claim(journal):
    with pytest.raises(JournalError, match="pending"):
        journal.finish_case("case-00000", [arm("case-00000")], verdict("case-00000"))
    journal.claim("case-00000", "w")
    interrupt_all(journal)
    # A worker thought lost must not change an interrupted case.
    with pytest.raises(JournalError, match="interrupted"):
        journal.finish_case("case-00000", [arm("case-00000")], verdict("case-00000"))
    with pytest.raises(KeyError):
        journal.finish_case("nope", [arm("nope")], verdict("nope"))
    assert journal.arms("case-00000") == {}


def test_finish_stores_the_verdict_once(journal):
    with pytest.raises(JournalError, match="not claimed"):
        journal.finish_case("case-00000", (), verdict("case-00000"))
    journal.claim("case-00000", "w")
    with pytest.raises(JournalError):
        journal.finish_case("case-00000", (), verdict("case-00001"))
    journal.finish_case("case-00000", (), verdict("case-00000", "rescued", 9))
    assert journal.state("case-00000") == "finished"
    assert journal.verdicts() == {"case-00000": verdict("case-00000", "rescued", 9)}
    with pytest.raises(JournalError):
        journal.finish_case("case-00000", (), verdict("case-00000"))
    with pytest.raises(JournalError, match="not claimed or interrupted"):
        journal.interrupt("case-00000", verdict("case-00000"))


def test_interrupted_verdict_is_written_once(journal):
    journal.claim("case-00004", "w")
    interrupt_all(journal)
    with pytest.raises(DuplicateRecord):
        journal.interrupt("case-00004", verdict("case-00004", "unknown", 2))


def test_a_case_interrupted_without_its_verdict_is_settled_by_the_next_recovery(journal):
    # A recovery that stopped between the two (an older version, or a crash): the state moved, no verdict.
    journal.claim("case-00002", "w")
    conn = sqlite3.connect(journal.path)
    with conn:
        conn.execute("UPDATE cases SET state = 'interrupted', reason = 'interrupted' WHERE case_id = 'case-00002'")
    conn.close()
    assert journal.unsettled_ids() == ["case-00002"]
    assert interrupt_all(journal) == ["case-00002"]
    assert journal.verdicts()["case-00002"].label == "unknown"
    assert journal.unsettled_ids() == []


def test_one_batched_call_is_indexed_for_each_of_its_cases(journal):
    # A batched call answers two cases; each case's finish indexes the call for that case.
    for case_id in ("case-00000", "case-00001"):
        journal.claim(case_id, "w")
        journal.finish_case(case_id, (), verdict(case_id), ("call-1", "receipts/a.jsonl", "ab" * 32))
    assert [(r.call_id, r.path, r.line_sha256) for r in journal.receipt_index("case-00000")] == [
        ("call-1", "receipts/a.jsonl", "ab" * 32)]
    assert [r.case_id for r in journal.receipt_index()] == ["case-00000", "case-00001"]


# --- drain, meta, other connections -----------------------------------------


def test_drain_is_seen_by_another_connection_and_stops_claim_next(journal, study):
    with Journal.open(study) as other:
        assert not other.draining()
        other.request_drain()
        assert journal.draining()
        assert journal.claim_next("w") is None
        assert journal.pending_ids()[0] == "case-00000"
        journal.clear_drain()
        assert not other.draining()
        assert other.claim_next("w").case_id == "case-00000"


def test_meta_round_trips_json_values(journal):
    journal.set_meta("config", {"chunk": 16, "model": "m"})
    journal.set_meta("config", {"chunk": 8})
    assert journal.meta()["config"] == {"chunk": 8}
    with pytest.raises(JournalError):
        journal.set_meta("schema_version", 99)


def test_read_only_view_sees_writes_and_cannot_write(study):
    Journal.create(study, make_cases(3), {}).close()  # no writer open: only the file remains
    with Journal.open(study, readonly=True) as view, Journal.open(study) as writer:
        writer.claim("case-00000", "w")
        assert view.state("case-00000") == "claimed"
        assert view.counts()["claimed"] == 1
        with pytest.raises(sqlite3.OperationalError):
            view.claim("case-00001", "w")


def test_finish_case_records_arms_receipt_and_verdict_at_once(tmp_path):
    from rescue.core.manifest import Case
    from rescue.core.records import ArmResult, Assistance
    from rescue.core.verdicts import Verdict
    from rescue.study.journal import Journal

    case = Case(case_id="c1", suite="libero_object", task_id=0, init_state_index=0, env_seed=0, horizon=16)
    journal = Journal.create(tmp_path / "s", [case], {})
    assert journal.claim("c1", "w")
    arms = [
        ArmResult(case_id="c1", arm="control", status="complete", success=False, assistance=Assistance(status="control")),
        ArmResult(case_id="c1", arm="assisted", status="complete", success=True, assistance=Assistance(status="applied", call_id="k")),
    ]
    verdict = Verdict(case_id="c1", label="rescued", rule=9, reason="test")
    journal.finish_case("c1", arms, verdict, ("k", "receipts/receipts.jsonl", "ab" * 32))
    assert journal.state("c1") == "finished"
    assert set(journal.arms("c1")) == {"control", "assisted"}
    assert journal.verdicts()["c1"].label == "rescued"
    assert [row.call_id for row in journal.receipt_index("c1")] == ["k"]
    with pytest.raises(Exception):
        journal.finish_case("c1", arms, verdict)  # finished cases are final


def test_finish_case_is_atomic_on_a_duplicate_arm(tmp_path):
    from rescue.core.manifest import Case
    from rescue.core.records import ArmResult, Assistance
    from rescue.core.verdicts import Verdict
    from rescue.study.journal import DuplicateRecord, Journal

    case = Case(case_id="c1", suite="libero_object", task_id=0, init_state_index=0, env_seed=0, horizon=16)
    journal = Journal.create(tmp_path / "s", [case], {})
    journal.claim("c1", "w")
    arm = ArmResult(case_id="c1", arm="control", status="complete", success=False, assistance=Assistance(status="control"))
    with pytest.raises(DuplicateRecord):
        journal.finish_case("c1", [arm, arm], Verdict(case_id="c1", label="unknown", rule=2, reason="t"))
    # Nothing of the failed transaction remains: the case is still claimed with no arm.
    assert journal.state("c1") == "claimed" and journal.arms("c1") == {}
