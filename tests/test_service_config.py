"""What a job may choose: the allow-list of job-settable keys, the service's named endpoints and policies,
and the check of a stored study before it is resumed. Pure functions: no server, no simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.config_files import ConfigError, load_config
from rescue.service import api
from rescue.service.settings import NO_KEY_ENV, ServiceConfig, load_service_config
from rescue.service.job_request import JOB_KEYS, _leaves, job_request, key_problem, request_of, resolve_job, study_problems

pytestmark = pytest.mark.fast

SERVICE = """
[defaults]
vlm = "lab"

[vlm.lab]
base_url = "https://vlm.lab.example/v1"
api_key_env = "LAB_KEY"
models = ["small", "large"]
api = "chat"
requests_per_minute = 30

[vlm.ollama]
base_url = "http://127.0.0.1:11434/v1"

[policy.pi05]
url = "ws://gpu-box:8000"
api_key_env = "PI05_KEY"
observation = "openpi-libero"

[policy.vision_language]
factory = "rescue.embedded.vision_language:make_policy"

[limits]
simulators = 2
"""


@pytest.fixture
def service(tmp_path: Path) -> ServiceConfig:
    path = tmp_path / "service.toml"
    path.write_text(SERVICE)
    return load_service_config(path)


def _refused(data: dict, service: ServiceConfig | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        resolve_job(job_request(data), service or ServiceConfig())
    return str(err.value)


def test_every_key_of_a_study_configuration_is_settable_by_a_job_or_refused_by_name():
    # A key added to StudyConfig is refused until someone adds it to JOB_KEYS: this list says what is refused.
    leaves = {k for k, _ in _leaves(StudyConfig().model_dump(mode="json"))} | {"vlm.api_key"}
    refused = {k for k in leaves if key_problem(k)}
    assert refused == {
        "vlm.base_url", "vlm.api_key", "vlm.api_key_env", "vlm.api_key_from_config", "vlm.prompt_root",
        "policy.url", "policy.factory", "policy.api_key_env", "policy.observation_sha256", "policy.announced",
        "env.adapter", "env.episode_protocol_sha256", "vlm.server", "vlm.lab_budget", "vlm.lab_ledger", "policy.rng_control",
    }
    assert all(not key_problem(k) for k in JOB_KEYS)
    assert JOB_KEYS <= leaves  # no typo in the allow-list
    for key in refused:
        assert _refused({key.split(".")[0]: {key.split(".")[1]: "x"}}).startswith(f"config: {key}: not settable")
    assert _refused({"vlm": {"where": 1}, "shell": "rm"}) == "config: vlm.where: unknown key; shell: unknown key"


def test_a_job_gets_the_named_endpoint_and_policy_with_their_keys_and_nothing_else(service):
    config = resolve_job(job_request({"vlm": {"endpoint": "lab", "model": "large"}, "policy": {"name": "pi05"},
                                      "cases_in_flight": 2}), service)
    assert (config.vlm.base_url, config.vlm.api_key_env, config.vlm.model) == ("https://vlm.lab.example/v1", "LAB_KEY", "large")
    assert config.vlm.requests_per_minute == 30  # the endpoint's ceiling is the default
    assert (config.policy.url, config.policy.api_key_env, config.policy.observation) == ("ws://gpu-box:8000", "PI05_KEY", "openpi-libero")
    assert config.cases_in_flight == 2
    # The defaults: the named default endpoint and its first model; `vision_language`, the embedded policy.
    config = resolve_job(job_request({}), service)
    assert (config.vlm.base_url, config.vlm.model, config.policy.url) == ("https://vlm.lab.example/v1", "small", None)
    assert config.policy.factory == "rescue.embedded.vision_language:make_policy"
    # An endpoint without a key gets a variable the worker never passes on, not OPENAI_API_KEY.
    config = resolve_job(job_request({"vlm": {"endpoint": "ollama"}}), service)
    assert config.vlm.api_key_env == NO_KEY_ENV
    # Without a service file: the local endpoint and the embedded policies only.
    config = resolve_job(job_request({"policy": {"name": "scripted"}}), ServiceConfig())
    assert config.vlm.base_url == "local" and config.policy.factory == "rescue.embedded.scripted:make_policy"


@pytest.mark.parametrize(("data", "words"), [
    ({"vlm": {"endpoint": "openai"}}, "vlm.endpoint: the service offers no 'openai' (it offers: lab, ollama)"),
    ({"policy": {"name": "os"}}, "policy.name: the service offers no 'os'"),
    ({"vlm": {"model": "gpt-5"}}, "vlm.model: 'gpt-5' is not offered by this endpoint (it offers: small, large)"),
    ({"vlm": {"api": "responses"}}, "vlm.api: this endpoint takes 'chat' only"),
    ({"vlm": {"requests_per_minute": 1000}}, "vlm.requests_per_minute: at most 30"),
    ({"policy": {"name": "pi05", "observation": "privileged"}}, "policy.observation: this policy fixes it"),
    ({"env": {"simulators": 3}}, "env.simulators: at most 2"),
    ({"policy": {"processes": 3}}, "policy.processes: at most 2"),
    ({"vlm": {"prompt_template": "../../etc/passwd"}}, "vlm.prompt_template: the name of a template"),
    ({"vlm": {"prompt_template": "missing_v9"}}, "vlm.prompt_template: this endpoint has no template 'missing_v9'"),
    ({"vlm": {"endpoint": 3}}, "vlm.endpoint: a name"),
    ({"vlm": "https://evil.example"}, "vlm: a table of settings"),
])
def test_a_job_is_refused_naming_what_the_service_does_not_offer(service, data, words):
    assert words in _refused(data, service)


def test_a_cli_configuration_may_set_job_keys_only_and_an_older_full_dump_still_loads():
    request = request_of(load_config(None, {"env.simulators": 1, "cases_in_flight": 1, "vlm.model": "m"}))
    assert request.settings() == {"env": {"simulators": 1}, "cases_in_flight": 1, "vlm": {"model": "m"}}
    for flag, value in [("policy.url", "ws://host:1"), ("policy.factory", "os:system"), ("vlm.base_url", "http://h/v1")]:
        with pytest.raises(ConfigError, match=flag.replace(".", r"\.")):
            request_of(load_config(None, {flag: value}))
    with pytest.raises(ConfigError, match=r"vlm\.api_key:"):
        request_of(StudyConfig.model_validate({"vlm": {"api_key": "sk-mine"}}))
    # A job queued before: config.json held every key; the pointers at their defaults point nowhere new.
    old = StudyConfig.model_validate(json.loads(StudyConfig(cases_in_flight=1).model_dump_json()))
    assert resolve_job(request_of(old), ServiceConfig()).cases_in_flight == 1
    hostile = StudyConfig.model_validate({**json.loads(old.model_dump_json()), "env": {"adapter": "os:system"}})
    with pytest.raises(ConfigError, match=r"env\.adapter"):
        request_of(hostile)


def test_a_stored_study_is_checked_against_the_service_before_it_is_resumed(service):
    good = resolve_job(job_request({"policy": {"name": "pi05"}}), service)
    assert study_problems(good, service) == []
    # An older study made by the service: the bundled endpoint with the old default key variable.
    assert study_problems(StudyConfig(), ServiceConfig()) == []
    elsewhere = good.model_copy(update={"vlm": good.vlm.model_copy(update={"base_url": "http://evil.example/v1"})})
    assert study_problems(elsewhere, service) == ["vlm.base_url, vlm.api_key_env: not an endpoint of this service"]
    other_key = good.model_copy(update={"vlm": good.vlm.model_copy(update={"api_key_env": "WORKER_SECRET"})})
    assert study_problems(other_key, service)
    code = good.model_copy(update={"policy": good.policy.model_copy(update={"url": None, "factory": "os:system"})})
    assert study_problems(code, service) == ["policy.url, policy.factory, policy.api_key_env: not a policy of this service"]
    adapter = good.model_copy(update={"env": good.env.model_copy(update={"adapter": "os:system"})})
    assert study_problems(adapter, service) == ["env.adapter: not the service's simulator adapter"]


@pytest.mark.parametrize(("text", "words"), [
    ('[vlm.x]\nbase_url = "file:///etc"', "vlm.x.base_url"),
    ('[policy.p]\nurl = "ws://a:1"\nfactory = "a:b"', "give exactly one of url and factory"),
    ('[policy.p]\nfactory = "a:b"\napi_key_env = "K"', "api_key_env goes with a url"),
    ('[defaults]\nvlm = "nowhere"', "defaults.vlm = 'nowhere'"),
    ("vlm = {}", "[vlm] offers nothing"),
    ('[vlm.local]\nbase_url = "local"\nkey = "sk"', "vlm.local.key: unknown key"),
    ("[vlm", "not valid TOML"),
])
def test_a_bad_service_file_is_named(tmp_path, text, words):
    path = tmp_path / "service.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_service_config(path)
    assert str(err.value).startswith(str(path)) and words in str(err.value)
    with pytest.raises(ConfigError, match="no such service configuration file"):
        load_service_config(tmp_path / "absent.toml")


def test_answers_lose_the_hosts_paths_and_bodies_are_bounded(tmp_path):
    queue = tmp_path / "queue"
    text = (f"report: {queue}/jobs/j/study-1/report.html; rescue: [Errno 2] No such file: '/srv/secret/x.py' "
            f"at http://127.0.0.1:8000/v1 (ws://gpu:8000/a) in {queue}")
    assert api._scrub(text, queue) == ("report: jobs/j/study-1/report.html; rescue: [Errno 2] No such file: '…/x.py' "
                                       "at http://127.0.0.1:8000/v1 (ws://gpu:8000/a) in .")
    assert api._scrubbed({"a": [f"{queue.resolve()}/jobs"]}, queue) == {"a": ["jobs"]}
    assert api._parse(b'{"a": [[1]]}') == {"a": [[1]]}
    for raw, words in [(b"[" * 10_000 + b"]" * 10_000, "nests deeper"), (b"[" * 40 + b"]" * 40, "nests deeper"),
                       (b'{"a": "\\udc00"}', "not valid Unicode"), (b"\xff", "not JSON")]:
        with pytest.raises(ValueError, match=words):
            api._parse(raw)


def test_a_queued_job_holds_its_settings_and_choices_only_and_nothing_is_queued_when_refused(tmp_path, service):
    from conftest import write_cases

    from rescue.core.manifest import ManifestError
    from rescue.service.queue import find_job, read_request, submit_job

    manifest = write_cases(tmp_path / "m.jsonl", 2).read_bytes()
    queue = tmp_path / "queue"
    request = job_request({"vlm": {"endpoint": "ollama", "temperature": 0.5}, "env": {"simulators": 1}})
    spec = submit_job(queue, manifest, "m.jsonl", request, "named", service)
    job = find_job(queue, spec.job_id)
    assert json.loads(job.layout.config.read_text()) == {"vlm": {"temperature": 0.5}, "env": {"simulators": 1}}
    assert (spec.vlm_endpoint, spec.policy_name) == ("ollama", None)
    resolved = resolve_job(read_request(job), service)
    assert (resolved.vlm.base_url, resolved.vlm.temperature, resolved.env.simulators) == ("http://127.0.0.1:11434/v1", 0.5, 1)
    for config, error in [(job_request({"vlm": {"endpoint": "openai"}}), ConfigError),
                          (StudyConfig.model_validate({"policy": {"url": "ws://evil:1"}}), ConfigError)]:
        with pytest.raises(error):
            submit_job(queue, manifest, "m.jsonl", config, None, service)
    with pytest.raises(ConfigError, match="name: one line"):
        submit_job(queue, manifest, "m.jsonl", request, "a\nb", service)
    pilots = b"".join(line.replace(b'"group"', b'"pilot": true, "group"') + b"\n" for line in manifest.splitlines())
    with pytest.raises(ManifestError, match="main cohort is empty"):
        submit_job(queue, pilots, "m.jsonl", request, None, service)
    assert [p.name for p in (queue / "jobs").iterdir()] == [spec.job_id]
