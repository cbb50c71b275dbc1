"""What a LeRobot policy keeps between `select_action` calls: the attributes its `reset()` resets.

LeRobot's evaluation calls `policy.reset()` at every episode's start, so what `reset()` assigns, or resets in
place, is one episode's state: the action queue of a chunking policy (`_action_queue`, `_queues`), an
observation history (`_queues` when `n_obs_steps > 1`), ACT's temporal ensembler (`temporal_ensembler`, when
`temporal_ensemble_coeff` is set), a streaming policy's buffers and counters. It is read from the source of
`reset()` and of the policy's own methods it calls, and kept where the instance has it after a reset (ACT's
`reset()` names the ensembler and the queue; an instance has one of them). Without source to read, every
attribute of the instance beyond torch's own and the config counts.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

# The state of a policy whose select_action pops a queue that predict_action_chunk fills, and nothing else.
ACTION_QUEUES = ("_action_queue", "_queues")


def episode_state(policy: Any) -> tuple[list[str], list[str]]:
    """(attributes of the instance that hold one episode's state, submodules whose state `reset()` resets in
    place); call right after `policy.reset()`."""
    import torch

    names = _reset_names(type(policy))
    if names is None:
        names = set(vars(policy)) - set(vars(torch.nn.Module()))
    names.discard("config")
    modules = getattr(policy, "_modules", {})
    return sorted(n for n in names if n in vars(policy)), sorted(n for n in names if n in modules)


def beyond_action_queue(attributes: list[str]) -> list[str]:
    """The episode state a chunk (predict_action_chunk) cannot carry."""
    return [name for name in attributes if name not in ACTION_QUEUES]


def _reset_names(cls: type) -> set[str] | None:
    """The attributes of `self` that `cls.reset` (and the methods of cls it calls) assigns or calls a method of;
    None when some source cannot be read."""
    names: set[str] = set()
    seen: set[tuple[type, str]] = set()

    def visit(owner: type, method: str) -> bool:
        if (owner, method) in seen:
            return True
        seen.add((owner, method))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(owner, method))))
        except (OSError, TypeError, SyntaxError, AttributeError):
            return False
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    base = target.value if isinstance(target, ast.Subscript) else target
                    if _of_self(base):
                        names.add(base.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                called = node.func.value
                if _of_self(called):  # self.x.reset()
                    names.add(called.attr)
                elif _is_self(called) and callable(getattr(cls, node.func.attr, None)):
                    if not visit(_defining(cls, node.func.attr), node.func.attr):  # self.helper()
                        return False
                elif isinstance(called, ast.Call) and getattr(called.func, "id", None) == "super":
                    parent = _defining(cls, node.func.attr, after=owner)  # super().reset()
                    if parent is not None and not visit(parent, node.func.attr):
                        return False
        return True

    return names if visit(_defining(cls, "reset"), "reset") else None


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _of_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and _is_self(node.value)


def _defining(cls: type, method: str, after: type | None = None) -> Any:
    """The class of cls's MRO (past `after`, when given) whose body defines `method`."""
    mro = cls.__mro__
    if after is not None:
        mro = mro[mro.index(after) + 1:] if after in mro else ()
    return next((klass for klass in mro if method in vars(klass)), None)
