"""Advisors (DESIGN §11): several VLM configurations in one study, each judged against control and the sham,
every pair of them compared (exact McNemar, Newcombe CI, Holm across the pairs), usage and declared cost each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.case_records import ORIGINAL, injected, make_case, make_trace, with_arms

from rescue.core.classify import classify
from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.config_files import ConfigError, load_config
from rescue.core.configuration.vlm_config import TokenPrice
from rescue.core.digest import digest_text
from rescue.core.records import ArmResult, CaseRecord, Receipt, Usage
from rescue.core.verdicts import Verdict
from rescue.core.figures.stats import ranked, summarize
from rescue.core.figures.exact_stats import holm, mcnemar_exact, paired_diff_ci

pytestmark = pytest.mark.fast

DATA = Path(__file__).resolve().parent / "data"
NAMES = ("local", "wrong", "continue")


# --- configuration -----------------------------------------------------------------------------------------


def test_advisor_tables_make_one_arm_each_in_declared_order_and_the_first_is_primary(tmp_path):
    toml = tmp_path / "study.toml"
    toml.write_text(
        '[[advisor]]\nname = "local"\n\n'
        '[[advisor]]\nname = "gpt"\nbase_url = "https://api.openai.com/v1"\napi_key_env = "OPENAI_API_KEY"\n'
        'model = "gpt-4.1"\nprompt = "prompts/subgoal_v1.txt"\nprice = { input = 2.0, output = 8.0 }\n\n'
        '[sham]\nsource = "permuted"\nadvisor = "gpt"\n'
    )
    config = load_config(toml)
    assert config.arms == ("control", "assisted:local", "assisted:gpt", "sham")
    assert config.primary_arm == "assisted:local" and config.sham_donor_advisor == "gpt"
    gpt = config.advisors[1]
    # The prompt file is kept as the shipped template's name (its folder is the shipped one).
    assert (gpt.prompt_template, gpt.prompt_root, gpt.model, gpt.price.output) == ("subgoal_v1", None, "gpt-4.1", 8.0)
    assert [(n, arm) for n, arm, _ in config.advisor_configs()] == [("local", "assisted:local"), ("gpt", "assisted:gpt")]
    # The stored configuration reads back to the same arms and digest (a resumed study is the same study).
    again = StudyConfig.model_validate_json(config.model_dump_json())
    assert again.arms == config.arms and again.sha256() == config.sha256()
    # Advisors are part of the study's identity.
    other = StudyConfig.model_validate({**json.loads(config.model_dump_json()), "arms": ["control", "assisted"],
                                        "advisors": [{"name": "local"}, {"name": "gpt", "model": "gpt-4.1-mini"}]})
    assert other.sha256() != config.sha256()


def test_a_plain_vlm_table_is_one_advisor_whose_study_is_as_before():
    config = StudyConfig(sham={"source": "fixed"})
    assert config.arms == ("control", "assisted", "sham") and config.advisors is None
    assert config.advisor_configs() == [(None, "assisted", config.vlm)] and config.primary_arm == "assisted"
    # A config.json written before advisors, prices and the sham's donor advisor existed lacks them;
    # it loads to the same study and hashes as it did.
    older = config.model_dump(mode="json")
    older.pop("advisors")
    older["vlm"].pop("price")
    older["sham"].pop("advisor")
    assert StudyConfig.model_validate(older).sha256() == config.sha256()


@pytest.mark.parametrize(("data", "words"), [
    ({"advisor": [{"name": "a"}, {"name": "a"}]}, "two advisors named 'a'"),
    ({"advisor": [{"name": "a"}], "vlm": {"model": "gpt-4.1"}}, "put every VLM setting in each [[advisor]] table"),
    ({"advisor": [{"name": "a b"}]}, "advisors.0.name"),
    ({"advisor": [{"name": "a"}], "sham": {"source": "permuted", "advisor": "b"}}, "no [[advisor]] is named 'b'"),
    ({"advisor": [{"name": "a"}], "sham": {"source": "fixed", "advisor": "a"}}, "source is not permuted"),
    ({"arms": ["control", "assisted:x"]}, "no [[advisor]] is declared"),
    ({"advisor": [{"name": "a", "prompt": "prompts/none.txt"}]}, "no such template file"),
])
def test_advisor_declarations_that_cannot_run_are_refused_in_one_line(data, words):
    from rescue.core.configuration.config_files import validate_config

    with pytest.raises(ConfigError, match=None) as exc:
        validate_config(data, "study.toml")
    assert words in str(exc.value), str(exc.value)


def test_keys_given_in_the_file_go_to_their_advisor_and_are_never_stored():
    config = StudyConfig.model_validate({"advisor": [{"name": "a"}, {"name": "b", "api_key": "sk-secret"}]})
    keys = config.given_keys()
    assert list(keys) == ["assisted:b"] and "sk-secret" not in config.model_dump_json()
    stored = StudyConfig.model_validate_json(config.model_dump_json())
    assert stored.advisors[1].api_key is None and stored.advisors[1].api_key_from_config
    assert "advisor 'b'" in (stored.missing_key_message() or "")
    assert stored.with_keys(keys).advisors[1].resolved_api_key() == "sk-secret"


# --- classification ----------------------------------------------------------------------------------------


def _receipt(case_id: str, advisor: str, subgoal: str, *, usage: Usage | None = None, status: str = "ok") -> Receipt:
    call, req = f"call-{case_id}-{advisor}", f"req-{case_id}-{advisor}"
    return Receipt(
        kind="outcome", call_id=call, attempt=1, request_ids=[req], tokens={req: "tok"}, case_ids=[case_id],
        model_requested="m", model_reported="m", endpoint_kind="chat", prompt_template="p",
        prompt_template_sha256=digest_text("t"), prompt_sha256=digest_text("p"), started_at=0.0, finished_at=2.0,
        latency_s=2.0, status=status, response_sha256=digest_text("r"), subgoals={req: subgoal}, advisor=advisor,
        usage=usage or Usage(),
    )


def _advisor_arm(case_id: str, advisor: str, success: bool, subgoal: str | None = None) -> tuple[ArmResult, Receipt]:
    subgoal = subgoal or f"grasp what {advisor} says"
    base = make_case(case_id)
    instruction = injected(ORIGINAL, subgoal)
    r = _receipt(case_id, advisor, subgoal)
    a = base.assisted.assistance.model_copy(update={
        "subgoal": subgoal, "instruction": instruction, "instruction_digest": digest_text(instruction),
        "call_id": r.call_id, "request_id": r.request_ids[0],
    })
    arm = base.assisted.model_copy(update={"arm": f"assisted:{advisor}", "success": success, "assistance": a,
                                           "trace": make_trace("assisted", applied=instruction)})
    return arm, r


def advisor_case(case_id: str, outcomes: dict[str, bool], control: bool = False, sham: bool | None = None) -> CaseRecord:
    """A valid case of a study of several advisors: each advisor's arm applied its own call's subgoal."""
    base = make_case(case_id, control_success=control)
    arms, receipts = {}, {}
    for name, ok in outcomes.items():
        arms[f"assisted:{name}"], receipts[f"assisted:{name}"] = _advisor_arm(case_id, name, ok)
    first = next(iter(outcomes))
    rec = base.model_copy(update={"primary": f"assisted:{first}", "arms": {"control": base.control, **arms},
                                  "receipts": receipts})
    if sham is not None:
        text = "Continue with the task."
        instruction = injected(ORIGINAL, text)
        s = base.assisted.model_copy(update={
            "arm": "sham", "success": sham, "trace": make_trace("sham", applied=instruction),
            "assistance": base.assisted.assistance.model_copy(update={
                "subgoal": text, "instruction": instruction, "instruction_digest": digest_text(instruction),
                "source": "fixed", "source_sha256": digest_text(text), "call_id": None, "request_id": None}),
        })
        rec = with_arms(rec, {"sham": s}, sham_source="fixed", sham_text=text)
    return rec


def test_each_advisor_is_judged_against_control_and_the_primarys_verdict_is_the_label():
    rec = advisor_case("c1", {"local": True, "wrong": False, "continue": True}, sham=False)
    v = classify(rec)
    assert list(v.arms) == ["assisted:wrong", "assisted:continue", "sham"]  # the primary's is the label
    by = {n: v.of(f"assisted:{n}", rec.primary) for n in NAMES}
    assert (by["local"].label, by["wrong"].label, by["continue"].label) == ("rescued", "not_rescued", "rescued")
    assert by["wrong"].rule == 8 and "assisted:wrong arm failed" in by["wrong"].reason
    assert (v.label, v.rule, v.in_m, v.in_e) == ("rescued", 9, True, True)  # the primary's
    assert v.arms["sham"].label == "not_rescued"


def test_an_advisor_arm_tied_to_another_advisors_receipt_has_no_evidence():
    rec = advisor_case("c1", {"local": True, "wrong": True})
    # The wrong-object advisor's arm points at a receipt the local advisor's call wrote (same case, same subgoal).
    forged = rec.receipts["assisted:wrong"].model_copy(update={"advisor": "local"})
    v = classify(with_arms(rec, receipts={"assisted:wrong": forged}))
    assert v.label == "rescued"  # the primary's (local)
    assert (v.arms["assisted:wrong"].label, v.arms["assisted:wrong"].rule) == ("unknown", 6)
    assert "a call of advisor 'local', not of advisor 'wrong'" in v.arms["assisted:wrong"].reason
    # A failed call of one advisor leaves the others' verdicts alone.
    wrong = rec.arms["assisted:wrong"]
    failed = wrong.model_copy(update={"assistance": wrong.assistance.model_copy(
        update={"status": "timeout", "subgoal": None, "instruction": None, "instruction_digest": None, "error_kind": "timeout"})})
    v = classify(with_arms(rec, {"assisted:wrong": failed}))
    assert (v.arms["assisted:wrong"].rule, v.label) == (3, "rescued")


def test_a_one_vlm_studys_receipts_name_no_advisor_and_one_naming_an_advisor_is_no_evidence():
    rec = make_case("x", assisted_success=True)
    assert classify(rec).label == "rescued" and classify(rec).arms == {}
    named = rec.receipt.model_copy(update={"advisor": "gpt"})
    assert classify(with_arms(rec, receipts={"assisted": named})).rule == 6


# --- statistics --------------------------------------------------------------------------------------------


def test_holm_adjusts_step_down_and_keeps_the_order():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    assert holm([0.02, 0.03, 0.04]) == pytest.approx([0.06, 0.06, 0.06])  # monotone: never below a smaller p's
    assert holm([0.6, 0.7]) == [1.0, 1.0]  # capped at 1
    assert holm([]) == []


def _cohort() -> list[CaseRecord]:
    # 40 cases: local rescues 30, wrong 2 (both also local's), continue 6 (4 of them local's too); sham rescues 3.
    out = []
    for i in range(40):
        local = i < 30
        wrong = i in (0, 1)
        cont = i in (0, 1, 2, 3, 35, 36)
        out.append(advisor_case(f"k{i:02d}", {"local": local, "wrong": wrong, "continue": cont}, sham=i in (5, 6, 37)))
    return out


def test_advisors_are_summarized_each_against_control_and_sham_and_paired_with_holm():
    records = _cohort()
    s = summarize(records, [classify(r) for r in records])
    # The headline is the primary advisor's.
    assert (s.n, s.r, s.m, s.e) == (40, 30, 40, 40)
    by = {f.arm.removeprefix("assisted:"): f for f in s.figures() if f.arm != "sham"}
    assert list(by) == list(NAMES) and s.arm == "assisted:local"
    assert (by["local"].r, by["wrong"].r, by["continue"].r) == (30, 2, 6)
    assert by["continue"].r_over_e == pytest.approx(6 / 40)
    wrong = by["wrong"].versus_control
    assert (wrong.pairs.first_only, wrong.pairs.second_only, wrong.pairs.both_fail) == (2, 0, 38)
    assert wrong.mcnemar_p == pytest.approx(mcnemar_exact(2, 0))
    # Against the sham: K = 40, local-only 28, sham-only 1 (case 37), both 2 (cases 5 and 6).
    sham = s.comparison("assisted:local", "sham")
    assert (sham.k, sham.pairs.first_only, sham.pairs.second_only, sham.pairs.both_success) == (40, 28, 1, 2)
    assert sham.diff_ci == pytest.approx(paired_diff_ci(28, 1, 40, both_success=2))
    # Every pair of advisors, declared order within each, Holm across the three.
    pairs = {(p.first.removeprefix("assisted:"), p.second.removeprefix("assisted:")): p
             for p in s.comparisons if p.holm_p is not None}
    assert list(pairs) == [("local", "wrong"), ("local", "continue"), ("wrong", "continue")]
    lw, lc, wc = pairs[("local", "wrong")], pairs[("local", "continue")], pairs[("wrong", "continue")]
    assert (lw.k, lw.pairs.first_only, lw.pairs.second_only, lw.pairs.both_success, lw.pairs.both_fail) == (40, 28, 0, 2, 10)
    assert (lc.pairs.first_only, lc.pairs.second_only, lc.pairs.both_success) == (26, 2, 4)
    assert (wc.pairs.first_only, wc.pairs.second_only, wc.pairs.both_success) == (0, 4, 2)
    raw = [mcnemar_exact(28, 0), mcnemar_exact(26, 2), mcnemar_exact(0, 4)]
    assert [p.mcnemar_p for p in pairs.values()] == pytest.approx(raw)
    assert [p.holm_p for p in pairs.values()] == pytest.approx(holm(raw))
    assert lw.holm_p < 0.05 and lc.holm_p < 0.05 and wc.holm_p > 0.05
    assert lw.diff == pytest.approx(28 / 40) and lw.diff_ci == pytest.approx(paired_diff_ci(28, 0, 40, both_success=2))
    assert [f.arm for f in ranked(list(by.values()))] == ["assisted:local", "assisted:continue", "assisted:wrong"]
    # A summary of two arms has no fields of other arms at all.
    plain = [make_case(f"p{i}", assisted_success=i < 2) for i in range(4)]
    dumped = summarize(plain, [classify(r) for r in plain]).model_dump(mode="json")
    assert "arms" not in dumped and "comparisons" not in dumped


def test_only_cases_both_advisors_have_in_e_are_paired():
    records = _cohort()[:4]
    bad = records[0].receipts["assisted:wrong"].model_copy(update={"subgoals": {}})
    records[0] = with_arms(records[0], receipts={"assisted:wrong": bad})
    s = summarize(records, [classify(r) for r in records])
    assert s.comparison("assisted:local", "assisted:wrong").k == 3 and s.comparison("assisted:local", "assisted:continue").k == 4
    assert {f.arm: f.e for f in s.figures() if f.arm != "sham"} == {"assisted:local": 4, "assisted:wrong": 3, "assisted:continue": 4}


def test_verdicts_of_a_study_of_several_advisors_round_trip():
    rec = advisor_case("c", {"local": True, "wrong": False})
    v = classify(rec)
    assert Verdict.model_validate_json(v.model_dump_json()) == v


# --- usage and cost ----------------------------------------------------------------------------------------


def test_cost_needs_a_declared_price_and_every_count_it_uses():
    from rescue.study.usage import study_usage

    config = StudyConfig.model_validate({"advisor": [
        {"name": "local"},
        {"name": "gpt", "price": {"input": 2.0, "output": 8.0}},
        {"name": "cached", "price": {"input": 2.0, "cached_input": 0.5, "output": 8.0}},
    ]})
    full = Usage(input_tokens=1_000_000, cached_input_tokens=400_000, output_tokens=100_000)
    receipts = [
        _receipt("a", "local", "x", usage=full), _receipt("a", "gpt", "x", usage=full),
        _receipt("b", "gpt", "x", usage=full), _receipt("a", "cached", "x", usage=full),
        _receipt("b", "cached", "x", usage=Usage(input_tokens=10, output_tokens=1)),  # no cached count: unknown
    ]
    total, by = study_usage(receipts, config)
    assert list(by) == ["local", "gpt", "cached"] and by["gpt"].calls == 2 and total.calls == 5
    assert by["local"].cost is None  # no price declared: never guessed
    assert by["gpt"].cost == pytest.approx(2 * (2.0 + 0.8))
    assert by["cached"].cost is None and total.cost is None
    price = TokenPrice(input=2.0, cached_input=0.5, output=8.0)
    assert price.cost(1_000_000, 400_000, 100_000) == pytest.approx(0.6 * 2.0 + 0.4 * 0.5 + 0.8)
    total, by = study_usage(receipts[1:3], config)
    assert total.cost is None  # the local advisor declared no price
    # A study of one [vlm] prices its calls with [vlm] price.
    one = StudyConfig(vlm={"price": {"input": 1.0, "output": 1.0}})
    plain = [r.model_copy(update={"advisor": None}) for r in receipts[:2]]
    total, by = study_usage(plain, one)
    assert by is None and total.cost == pytest.approx(2 * 1.1)


# --- exports of the version before still read --------------------------------------------------------------


def test_an_export_of_the_previous_schema_still_reads(tmp_path):
    # tests/data/export_v3/export.json: `rescue export --partial` of tests/data/study_before_floors by the
    # code before advisors (commit 1a2df23).
    from rescue.read.export import EXPORT_SCHEMA, ExportError, read_export

    old = read_export(DATA / "export_v3" / "export.json")
    assert old.schema_version == "rescue-export/3" and EXPORT_SCHEMA == "rescue-export/8"
    # Read into today's shape: the sham's figures and its comparison with the assisted arm, no advisors.
    assert [f.arm for f in old.summary.arms] == ["sham"] and old.summary.comparison("assisted", "sham") is not None
    assert not any(c.first.startswith("assisted:") for c in old.summary.comparisons) and old.usage_by_advisor is None
    assert [c.case_id for c in old.cases][:2] == ["object-3-ep0", "object-3-ep1"]
    future = tmp_path / "export.json"
    future.write_text((DATA / "export_v3" / "export.json").read_text().replace("rescue-export/3", "rescue-export/9"))
    with pytest.raises(ExportError, match="rescue-export/9"):
        read_export(future)


# --- the service: advisors name its endpoints --------------------------------------------------------------


def test_a_service_job_names_an_endpoint_per_advisor_and_nothing_else():
    from rescue.service.settings import ServiceConfig
    from rescue.service.job_request import job_request, resolve_job, study_problems

    service = ServiceConfig.model_validate({
        "vlm": {"local": {"base_url": "local"},
                "lab": {"base_url": "https://vlm.lab.example/v1", "api_key_env": "LAB_KEY", "models": ["small", "large"]}},
    })
    request = job_request({"advisor": [{"name": "here"}, {"name": "there", "endpoint": "lab", "model": "large",
                                                          "price": {"input": 1.0, "output": 2.0}}]})
    config = resolve_job(request, service)
    here, there = config.advisors
    assert (here.base_url, here.endpoint) == ("local", "local")
    assert (there.base_url, there.api_key_env, there.model, there.endpoint) == ("https://vlm.lab.example/v1", "LAB_KEY", "large", "lab")
    assert config.arms == ("control", "assisted:here", "assisted:there") and study_problems(config, service) == []
    with pytest.raises(ConfigError, match=r"advisors\[0\] \(x\)\.base_url: not settable by a job"):
        job_request({"advisors": [{"name": "x", "base_url": "http://evil.example/v1"}]})
    with pytest.raises(ConfigError, match=r"advisors\[0\] \(x\)\.prompt: a file of the worker's host"):
        job_request({"advisors": [{"name": "x", "prompt": "/etc/passwd"}]})
    with pytest.raises(ConfigError, match="is not offered by this endpoint"):
        resolve_job(job_request({"advisors": [{"name": "x", "endpoint": "lab", "model": "huge"}]}), service)
    # A stored study whose advisor points elsewhere is not this service's to resume.
    moved = config.model_copy(update={"advisors": [here, there.model_copy(update={"base_url": "https://elsewhere/v1"})]})
    assert study_problems(moved, service) == ["advisors[1] (there).base_url, advisors[1] (there).api_key_env: "
                                              "not an endpoint of this service"]


def test_one_advisor_whose_first_calls_all_fail_alike_stops_the_study_naming_its_arm():
    from rescue.core.failfast import FailFast
    from rescue.core.records import Assistance

    def arm(name: str, status: str, kind: str | None = None) -> ArmResult:
        return ArmResult(case_id="c", arm=name, status="complete", success=False,
                         assistance=Assistance(status=status, error_kind=kind, error="401 Incorrect API key"))

    watch = FailFast(3)
    causes = [watch.observe([arm("control", "control"), arm("assisted:local", "applied"),
                             arm("assisted:gpt", "broker_error", "auth")]) for _ in range(3)]
    assert causes[:2] == [None, None]
    assert causes[2].startswith("the first 3 VLM calls of assisted:gpt all failed with VLM auth")
