"""One strict schema for every way a study is asked for: `rescue run`'s TOML, `rescue submit`'s TOML, `POST /jobs`.

The property test generates configurations (good and bad numbers, strings and bools where numbers go, `inf`
and `nan`, query points, a dotted key beside its table) and asks all three surfaces: the real CLI in process
for `run` (a refusal comes before any simulator) and `submit`, the real aiohttp application on loopback for
the API. Each must give the same verdict; a refusal is one line, exit 2 or HTTP 400, and nothing is written.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import tempfile
import time
from contextlib import redirect_stderr
from io import StringIO
from pathlib import Path

import pytest
from conftest import write_cases
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rescue import cli
from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.config_files import ConfigError, load_config
from rescue.service.api import make_app
from rescue.service.settings import load_service_config

pytestmark = pytest.mark.fast

# Limits as wide as a study's own ranges: the service's verdict is then the study schema's.
WIDE_SERVICE = """
[limits]
simulators = 4096
cases_in_flight = 100000
image_size = 4096
"""

WRONG = st.sampled_from(["3", True, False, "x"])
FLOATS = st.sampled_from([math.inf, -math.inf, math.nan])


def _num(good: list, bad: list, floats: bool = False):
    return st.one_of(st.sampled_from(good), st.sampled_from(bad), WRONG, *([FLOATS] if floats else []))


KEYS = {
    "continuations": _num([1, 2, 3], [0, -1, 101, 100, 2.5]),
    "cases_in_flight": _num([1, 4], [0, -3]),
    "keepalive_s": _num([0.5, 120.0, 5], [-5.0, 0.0, 0.01, 1e9], floats=True),
    "fail_fast_arms": _num([0, 3], [-1]),
    "env.simulators": _num([1, 2], [0, -1, 5000]),
    "env.image_size": _num([1, 64, 256], [-1, 0, 5000]),
    "env.max_simulator_rss_gb": _num([2.5, 1], [0, 1e300, -1.0], floats=True),
    "vlm.deadline_s": _num([10.0, 1200], [-1, 0], floats=True),
    "vlm.batch_size": _num([1, 4], [0, 1000000]),
    "vlm.temperature": _num([0.0, 1.0], [3.0, -0.5], floats=True),
    "vlm.max_output_tokens": _num([200], [0, -1]),
}


@st.composite
def configs(draw) -> dict:
    data: dict = {}
    for dotted in draw(st.lists(st.sampled_from(sorted(KEYS)), max_size=4, unique=True)):
        section, _, key = dotted.rpartition(".")
        (data.setdefault(section, {}) if section else data)[key] = draw(KEYS[dotted])
    if draw(st.booleans()):
        data["vlm"] = {**data.get("vlm", {}), "price": {"input": draw(_num([1.0, 0], [-1.0], floats=True)),
                                                      "output": 2.0}}
    points = draw(st.integers(0, 3))
    if points:
        data["query_point"] = [{"name": f"p{i}", "fraction": draw(_num([0.25, 0.75], [0, 1.0, 1.5], floats=True))}
                               for i in range(points)]
    if draw(st.integers(0, 4)) == 0:
        # A dotted key beside the table it names: refused everywhere.
        data.setdefault("env", {})["simulators"] = 1
        data["env.simulators"] = 2
    return data


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


def to_toml(data: dict) -> str:
    """The configuration as a TOML file (dotted keys quoted, tables, arrays of tables)."""
    lines = [f"{json.dumps(k) if '.' in k else k} = {_toml_value(v)}" for k, v in data.items()
             if not isinstance(v, (dict, list))]
    for key, value in data.items():
        if isinstance(value, dict):
            lines += [f"[{key}]", *(f"{k} = {_toml_value(v)}" for k, v in value.items())]
        elif isinstance(value, list):
            for entry in value:
                lines += [f"[[{key}]]", *(f"{k} = {_toml_value(v)}" for k, v in entry.items())]
    return "\n".join(lines) + "\n"


def _jobs(queue: Path) -> list[Path]:
    folder = queue / "jobs"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _cli(*args: str) -> tuple[int, list[str]]:
    err = StringIO()
    with redirect_stderr(err):
        code = cli.main(list(args))
    return code, err.getvalue().strip().splitlines()


async def _post(app, body: dict) -> tuple[int, dict]:
    from aiohttp.test_utils import TestClient, TestServer

    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        r = await client.post("/jobs", data=json.dumps(body), headers={"Content-Type": "application/json"})
        return r.status, await r.json()


def verdicts(root: Path, data: dict) -> dict[str, bool]:
    """Each surface's verdict (True: accepted), checking that a refusal is one line, exit 2 or 400, nothing written."""
    manifest = write_cases(root / "m.jsonl", 1, horizon=64)
    service = root / "service.toml"
    service.write_text(WIDE_SERVICE)
    config = root / "study.toml"
    config.write_text(to_toml(data))
    out: dict[str, bool] = {}
    # rescue run: its configuration is read first; a refused one exits 2 before anything runs or is written.
    try:
        load_config(config)
        out["run"] = True
    except ConfigError:
        code, err = _cli("run", str(manifest), "--study", str(root / "study"), "--config", str(config))
        assert code == 2 and len(err) == 1 and err[0].startswith(f"rescue: {config}: "), (code, err)
        assert not (root / "study").exists() and not (root / "receipts").exists()
        out["run"] = False
    # rescue submit.
    queue = root / "queue-cli"
    code, err = _cli("submit", str(manifest), "--queue", str(queue), "--config", str(config),
                     "--service-config", str(service))
    assert code in (0, 2), (code, err)
    if code == 2:
        assert len(err) == 1 and not _jobs(queue), err
    out["submit"] = code == 0
    # POST /jobs on the real application, on loopback.
    api_queue = root / "queue-api"
    app = make_app(api_queue, None, None, load_service_config(service))
    status, body = asyncio.run(_post(app, {"manifest": manifest.read_text(), "config": data}))
    assert status in (201, 400), (status, body)
    if status == 400:
        assert len(body["problems"]) == 1 and "\n" not in body["problems"][0] and not _jobs(api_queue), body
    out["api"] = status == 201
    return out


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_the_three_surfaces_give_every_configuration_the_same_verdict(data):
    with tempfile.TemporaryDirectory() as tmp:
        seen = verdicts(Path(tmp), data)
    assert len(set(seen.values())) == 1, (data, seen)


@pytest.mark.parametrize("data, words", [
    ({"continuations": "3"}, "continuations: a whole number, not str '3'"),
    ({"continuations": True}, "continuations: a whole number, not bool True"),
    ({"query_point": [{"name": "a", "fraction": "0.25"}]}, "fraction: a number, not str '0.25'"),
    ({"vlm": {"price": {"input": math.inf, "output": 0.0}}}, "vlm.price.input: inf is not a finite number"),
    ({"env": {"max_simulator_rss_gb": math.inf}}, "env.max_simulator_rss_gb: inf is not a finite number"),
    ({"keepalive_s": math.inf}, "keepalive_s: inf is not a finite number"),
    ({"keepalive_s": -5}, "keepalive_s: -5 is out of range"),
    ({"env": {"image_size": 0}}, "env.image_size: 0 is out of range"),
    ({"vlm": {"deadline_s": -1}}, "vlm.deadline_s: -1 is out of range"),
    ({"vlm": {"batch_size": 1000000}}, "vlm.batch_size: 1000000 is out of range"),
    ({"env": {"max_simulator_rss_gb": 1e300}}, "env.max_simulator_rss_gb: 1e+300 is out of range"),
    ({"env": {"simulators": 1}, "env.simulators": 2}, "env.simulators: given both as a dotted key and in the table env"),
    ({"continuations": 100, "query_point": [{"name": f"p{i}", "fraction": (i + 1) / 100} for i in range(49)]},
     "control, 1 advisor, 49 query points = 51 arms × 100 continuations = 5,100 arms per case; the limit is 1,024"),
])
def test_what_the_campaign_found_is_refused_in_one_line_on_every_surface(tmp_path, data, words):
    assert verdicts(tmp_path, data) == {"run": False, "submit": False, "api": False}
    err = _cli("run", str(tmp_path / "m.jsonl"), "--study", str(tmp_path / "s"), "--config",
               str(tmp_path / "study.toml"))[1]
    assert words in err[0]


def test_a_dotted_key_beside_its_table_is_refused_by_the_api_naming_it(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=64).read_text()
    app = make_app(tmp_path / "queue", None, None, None)
    status, body = asyncio.run(_post(app, {"manifest": manifest, "config": {"vlm.model": "x", "vlm": {"model": "y"}}}))
    assert status == 400 and body["problems"] == [
        "config: vlm.model: given both as a dotted key and in the table vlm; give each key once"]
    assert not _jobs(tmp_path / "queue")


def test_rescue_submit_takes_the_query_point_tables_rescue_run_takes(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=64)
    config = tmp_path / "study.toml"
    config.write_text('[[query_point]]\nname = "early"\nfraction = 0.25\n')
    assert load_config(config).query_points[0].name == "early"
    code, err = _cli("submit", str(manifest), "--queue", str(tmp_path / "q"), "--config", str(config))
    assert code == 0, err
    (job,) = _jobs(tmp_path / "q")
    assert json.loads((job / "config.json").read_text())["query_points"] == [{"name": "early", "fraction": 0.25}]


def test_the_service_limits_lower_the_work_a_job_may_ask_and_a_refusal_names_the_product(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 3, horizon=64)
    service = tmp_path / "service.toml"
    service.write_text("[limits]\narms_per_case = 4\narm_steps = 400\n")
    config = tmp_path / "study.toml"
    config.write_text("continuations = 3\n")
    code, err = _cli("submit", str(manifest), "--queue", str(tmp_path / "q"), "--config", str(config),
                     "--service-config", str(service))
    assert code == 2 and err == ["rescue: config: control, 1 advisor = 2 arms × 3 continuations = 6 arms per case; "
                                 "the limit is 4"]
    config.write_text("continuations = 2\n")
    code, err = _cli("submit", str(manifest), "--queue", str(tmp_path / "q"), "--config", str(config),
                     "--service-config", str(service))
    # Two continuations fork at q = 32: 64 + 3 x 32 = 160 steps a case, not 4 x 64.
    assert code == 2 and err == ["rescue: config: 3 cases × 4 arms per case = 480 arm-steps (forked arms share each "
                                 "case's prefix), about 0.0 h on 2 simulators and 1.9 MB of disk; the limit is 400 "
                                 "arm-steps"], err
    assert not _jobs(tmp_path / "q")
    with pytest.raises(ConfigError, match="arms_per_case: Input should be less than or equal to 1024"):
        load_service_config(_write(tmp_path / "s2.toml", "[limits]\narms_per_case = 1025\n"))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_query_point_that_cannot_fire_within_the_horizon_is_refused_before_anything_exists(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=32)
    config = _write(tmp_path / "study.toml", '[policy]\nreplan_interval = 16\n[[query_point]]\nname = "late"\n'
                                             'fraction = 0.99\n')
    code, err = _cli("run", str(manifest), "--study", str(tmp_path / "s"), "--config", str(config))
    assert code == 2 and err == ["rescue: query_points: 'late' (fraction 0.99) asks at step 32, which a case of horizon "
                                 "32 never reaches (C = 16): it cannot fire within H"]
    assert not (tmp_path / "s").exists()
    code, err = _cli("submit", str(manifest), "--queue", str(tmp_path / "q"), "--config", str(config))
    assert code == 2 and "it cannot fire within H" in err[0] and not _jobs(tmp_path / "q")


@pytest.mark.parametrize("kind", ["fifo", "garbage", "directory"])
def test_a_ledger_that_cannot_be_used_is_named_before_the_study_exists(tmp_path, kind):
    lab = tmp_path / "lab"
    lab.mkdir()
    ledger = lab / "receipts" / "ledger.sqlite"
    ledger.parent.mkdir()
    if kind == "fifo":
        os.mkfifo(ledger)
    elif kind == "garbage":
        ledger.write_bytes(b"not a database at all" * 100)
    else:
        ledger.mkdir()
    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=64)
    config = _write(tmp_path / "study.toml", f'[vlm]\nlab_budget = 5.0\nlab_ledger = "{lab / "receipts"}"\n'
                                             'price = { input = 1.0, output = 1.0 }\n')
    code, err = _cli("run", str(manifest), "--study", str(tmp_path / "s"), "--config", str(config))
    assert code == 2 and len(err) == 1 and err[0].startswith(f"rescue: {ledger}: the lab's ledger "), err
    assert not (tmp_path / "s").exists()


def test_the_job_settable_keys_in_the_docs_are_the_codes():
    from rescue.service import keydocs

    for path, text in keydocs.current().items():
        assert path.read_text(encoding="utf-8") == text, f"run `{keydocs.COMMAND}`"
    listed = keydocs.job_keys_markdown()
    for key in ("continuations", "env.episode_protocol", "env.instruction", "env.max_simulator_rss_gb",
                "policy.stateless", "advisors", "query_points"):
        assert f"`{key.split('.')[-1]}`" in listed


def test_a_body_that_does_not_arrive_whole_is_cut_off(tmp_path):
    from aiohttp import web

    async def main() -> bytes:
        runner = web.AppRunner(make_app(tmp_path / "queue", None, None, None, body_timeout_s=1.0))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            # A real slow client on loopback: its Content-Length claims more than it ever sends.
            return await asyncio.to_thread(_slow_client, port)
        finally:
            await runner.cleanup()

    answer = asyncio.run(main())
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"did not arrive whole" in answer
    assert not _jobs(tmp_path / "queue")


def _slow_client(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{\"manifest\": ")
        received = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return received + b" (no answer within the client's own 60 s)"
            if not chunk:
                return received  # the server closed the connection
            received += chunk
            time.sleep(0)


def test_rescue_run_refuses_more_work_than_the_machine_gives_with_the_estimate_before_anything_exists(tmp_path):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(
        json.dumps({"case_id": f"c{t}-{i}", "suite": "libero_object", "task_id": t, "init_state_index": i,
                    "env_seed": i, "horizon": 2800}) + "\n" for t in range(10) for i in range(12)))
    config = _write(tmp_path / "study.toml", "continuations = 100\n")
    code, err = _cli("run", str(manifest), "--study", str(tmp_path / "s"), "--config", str(config))
    # Forked continuations share each case's prefix: 2,800 + 199 x 1,400 steps a case, not 200 x 2,800.
    assert code == 2 and err == ["rescue: 120 cases × 200 arms per case = 33,768,000 arm-steps (forked arms share each "
                                 "case's prefix), about 173.5 h on 2 simulators and 3.8 GB of disk; the limit is 168 h "
                                 "(rescue run --max-hours raises it)"], err
    assert not (tmp_path / "s").exists()

def test_the_large_studies_users_run_are_accepted_with_their_estimate():
    """The full-size set-up of benchmarks/ (10 query points, K = 5, a sham and a second advisor) on 1,004 cases, and
    1,004 libero_10 cases at their official horizon with 10 query points and K = 5: refused before, by a count of
    arms (65 > 64) or of unshared arm-steps (24.6 M > 20 M), accepted now with what they will cost."""
    from rescue.core.configuration.work_limit import config_arms_problem, config_work_problem, work_estimate

    points = [{"name": f"p{i}", "fraction": f} for i, f in enumerate((0.1, 0.2, 0.3, 0.4, 0.45, 0.55, 0.6, 0.7, 0.8, 0.9))]
    full = StudyConfig.model_validate({"query_point": points, "continuations": 5, "sham": {"source": "fixed"},
                                       "advisor": [{"name": "a"}, {"name": "b"}], "policy": {"replan_interval": 8}})
    assert len(full.case_arms) == 70 and config_arms_problem(full) is None
    assert config_work_problem(full, [280] * 1004, free_disk=80 * 10**9) is None
    long = StudyConfig.model_validate({"query_point": points, "continuations": 5, "policy": {"replan_interval": 5}})
    assert config_work_problem(long, [520] * 1004, free_disk=80 * 10**9) is None
    estimate = work_estimate(long, [520] * 1004)
    assert estimate.arm_steps < 24_600_000 and estimate.hours < 168
    assert estimate.text().startswith("1,004 cases × 60 arms per case = ")
    # The same study on a disk that cannot hold it is refused, saying how much it needs and has.
    assert "GB of disk; the study's file system has 1.0 GB free" in config_work_problem(long, [520] * 1004, free_disk=10**9)


def test_a_trigger_arm_is_estimated_from_the_first_step_its_trigger_can_fire_at():
    """A trigger's q is decided while the episode runs: the estimate forks it at the earliest step it can fire (a
    stall of window 3 at C = 8: step 24), never as an arm run whole and never past what runs."""
    from rescue.core.configuration.work_limit import case_arm_steps

    stall = {"trigger": [{"name": "stall", "kind": "stall", "window": 3, "distance": 0.02}]}
    config = StudyConfig.model_validate({**stall, "policy": {"replan_interval": 8}})
    assert config.case_arms == ("control", "assisted", "assisted@stall")
    # The leader 280, the assisted arm from q = 144, the stall's arm from step 24.
    assert case_arm_steps(config, 280) == 280 + (280 - 144) + (280 - 24)
    unknown_c = StudyConfig.model_validate(stall)  # C not yet known: the stall can fire from step 3 on
    assert case_arm_steps(unknown_c, 280) == 280 + (280 - 140) + (280 - 3)
    placebo = StudyConfig.model_validate({"trigger": [*stall["trigger"], {"name": "placebo", "kind": "random",
                                                                         "matches": "stall", "rate": 0.5}],
                                          "policy": {"replan_interval": 8}})
    assert case_arm_steps(placebo, 280) == 280 + (280 - 144) + 2 * (280 - 24)


def test_a_studys_own_policy_server_takes_every_arm_its_cases_in_flight_open():
    """The serving distribution caps connections (256 by default); a study of 70 arms a case, 4 cases in flight,
    opens up to 280 at once, so the server it starts for itself takes them."""
    from rescue.run.peers import policy_connections

    points = [{"name": f"p{i}", "fraction": (i + 1) / 11} for i in range(10)]
    big = StudyConfig.model_validate({"query_point": points, "continuations": 5, "sham": {"source": "fixed"},
                                      "advisor": [{"name": "a"}, {"name": "b"}]})
    assert len(big.case_arms) * big.cases_in_flight == 280 and policy_connections(big) == 296
    assert policy_connections(StudyConfig()) == 256
