"""`module:attr` names: the current ones and those of modules that moved resolve to the same object."""

from __future__ import annotations

import importlib

import pytest

from rescue.core.configuration.config import PolicyConfig
from rescue.core.configuration.names import MOVED, current_module, resolve

pytestmark = pytest.mark.fast

# Factory strings that studies made before the move hold in their config.json.
STORED_FACTORIES = {
    "rescue.policy.learned:make_policy": "rescue.embedded.learned:make_policy",
    "rescue.policy.vision_language:make_policy": "rescue.embedded.vision_language:make_policy",
    "rescue.policy.scripted:make_policy": "rescue.embedded.scripted:make_policy",
    "rescue.policy.variants:make_steady_policy": "rescue.embedded.variants:make_steady_policy",
}


@pytest.mark.parametrize("old, new", sorted(STORED_FACTORIES.items()))
def test_a_stored_factory_string_resolves_to_the_moved_object(old, new):
    assert resolve(old) is resolve(new)


def test_every_moved_module_exists_and_its_old_name_is_gone():
    for old, new in MOVED.items():
        importlib.import_module(new)
        try:
            stale = importlib.import_module(old)
        except ModuleNotFoundError:
            continue
        # Only a name that became a floor's folder (`rescue.study`) still imports: as that package.
        assert hasattr(stale, "__path__"), f"{old} is still a module beside {new}"


def test_a_renamed_module_resolves_under_its_old_name():
    assert resolve("rescue.service.config:load_service_config") is resolve("rescue.service.settings:load_service_config")
    assert resolve("rescue.read.html.compare:write_comparison_report") is resolve(
        "rescue.read.html.side_by_side:write_comparison_report")


def test_current_module_rewrites_a_prefix_only_at_a_dot():
    assert current_module("rescue.study") == "rescue.study.folder"
    assert current_module("rescue.studies") == "rescue.run.commands"
    assert current_module("rescue.report_html.cases") == "rescue.read.html.cases"
    assert current_module("rescue.core.records") == "rescue.core.records"  # already current
    assert current_module("my_lab.policies") == "my_lab.policies"


def test_the_default_factory_is_a_current_name():
    assert current_module(PolicyConfig().factory.partition(":")[0]) == PolicyConfig().factory.partition(":")[0]
