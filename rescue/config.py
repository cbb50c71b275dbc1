"""The study configuration: one pydantic model, loadable from TOML, overridable by flags."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rescue.digest import canonical_json, digest_text
from rescue.sham import ShamConfig
from rescue.vlm.settings import VLMConfig
from wrappers.async_rules import RulesConfig


class PolicyConfig(BaseModel):
    """Where the frozen policy is served, or which in-process policy to serve."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = None  # ws://host:port; None serves `factory` on loopback
    factory: str = "rescue.policy.learned:make_policy"
    api_key_env: str | None = None
    # C. None before a study is created: then the server's `action_horizon` decides it,
    # and the study's config.json holds the resolved value from then on.
    replan_interval: int | None = Field(default=None, gt=0)
    # The observation profile (DESIGN §7). None: what the server announces, else the
    # default for its kind (`privileged` for the bundled policies, `openpi-libero` otherwise).
    observation: str | None = None
    # The sha256 of that profile's definition, fixed at creation (a changed built-in is refused on resume).
    observation_sha256: str | None = None
    # What the server announced about itself when the study was created (identity.IDENTITY_KEYS);
    # a later start against a server announcing otherwise is refused.
    announced: dict[str, Any] | None = None


class EnvConfig(BaseModel):
    """Which simulator adapter to run and how many processes of it."""

    model_config = ConfigDict(extra="forbid")

    adapter: str = "rescue.env.libero:LiberoAdapter"
    simulators: int = 2
    image_size: int = 256


class StudyConfig(BaseModel):
    """Everything that decides how a study runs; its sha256 is written into the study folder."""

    model_config = ConfigDict(extra="forbid")

    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    # base_url "local" serves the bundled OpenAI-compatible endpoint on loopback.
    vlm: VLMConfig = Field(default_factory=lambda: VLMConfig(base_url="local"))
    # More cases than simulators keep the simulators busy while assisted arms wait for the VLM.
    cases_in_flight: int = 4
    # An assisted arm waiting at q snapshots its simulator and gives it back to the pool.
    release_simulator_while_waiting: bool = True
    # Opt-in: run the common prefix once and both arms from one snapshot at q (a disclosed mode).
    fork_at_q: bool = False
    # Render one view of each arm at q and at its end into the study's frames/ (for `rescue report`).
    keyframes: bool = True
    keepalive_s: float = 120.0
    # Stop claiming when the first K arms (or the first K assisted arms' VLM calls) all fail with
    # the same infrastructure error; 0 turns it off.
    fail_fast_arms: int = Field(default=3, ge=0)
    arms: tuple[str, ...] = ("control", "assisted")
    # Correction rules between the policy and the simulator; all off unless named in rules.enabled.
    rules: RulesConfig = Field(default_factory=RulesConfig)
    # An enabled rule whose inputs the policy's replies lack stops the study at its first query,
    # unless this is set (then the rule stays idle, and the arm records it in `idle_rules`).
    allow_idle_rules: bool = False
    # The sham (placebo) arm, off by default: DESIGN §8 and rescue/sham.py.
    sham: ShamConfig = Field(default_factory=ShamConfig)
    # The query point: the first regular policy query at or after half the horizon (DESIGN §2).
    query_rule: Literal["ceil(H/2/C)*C"] = "ceil(H/2/C)*C"

    @model_validator(mode="after")
    def _sham_arm(self) -> "StudyConfig":
        # A rescue study with a sham source runs the sham arm as its third arm.
        if self.sham.on and "assisted" in self.arms and "sham" not in self.arms:
            self.arms = (*self.arms, "sham")
        if "sham" in self.arms and not self.sham.on:
            raise ValueError("arms lists 'sham' but [sham] source is off")
        return self

    @property
    def is_evaluation(self) -> bool:
        """An evaluation study runs the control arm only and labels episodes."""
        return tuple(self.arms) == ("control",)

    @property
    def interval(self) -> int:
        """C of a created study (its config always holds the resolved value)."""
        if self.policy.replan_interval is None:
            raise ValueError("the configuration has no resolved replan_interval (not a created study's)")
        return self.policy.replan_interval

    def sha256(self) -> str:
        """Digest of the resolved configuration.

        Settings added after studies already existed count only when set, so the
        digest of an older study's config.json (written without them) still holds."""
        data = self.model_dump(mode="json")
        for section, key in HASHED_WHEN_SET:
            if data[section].get(key) is None:
                data[section].pop(key, None)
        return digest_text(canonical_json(data))


# (section, key) of settings added after studies existed: in the digest only when not None.
HASHED_WHEN_SET = (("vlm", "max_concurrent_calls"), ("vlm", "requests_per_minute"), ("sham", "by_task"))


class ConfigError(ValueError):
    """A configuration file or flag that cannot be used, named in one line."""


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> StudyConfig:
    """Read a TOML file (if any), apply dotted-key overrides, validate; ConfigError names what is wrong."""
    data: dict[str, Any] = {}
    where = str(path) if path is not None else "the command line"
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such configuration file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read it ({exc})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return validate_config(data, where)


def validate_config(data: dict[str, Any], where: str) -> StudyConfig:
    """A StudyConfig from plain data, or ConfigError naming every problem in one line (`where` first)."""
    try:
        return StudyConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"]) or "(top level)"
            what = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            problems.append(f"{key}: {what}")
        raise ConfigError(f"{where}: " + "; ".join(problems)) from None
