"""One typed config for a whole run, one module per section (``rubricem_core/config/``).

YAML profiles under ``data/profiles/`` set it; CLI ``--set a.b=value`` options and Prefect flow
parameters override it. The same pydantic model is the flow parameter, so the Prefect UI renders a
form for it. Secrets are never fields here: a config names the *environment variable* (or Prefect
Secret block) that holds a key, and the key is resolved at the point of use. This package's names are
its public surface: import them from ``rubricem_core.config``.
"""

from __future__ import annotations

from rubricem_core.config.base import PROFILES_DIR, ConfigError
from rubricem_core.config.data import (
    ALL_QUERY_KINDS,
    DataConfig,
    FilterConfig,
    QueryKind,
    QuerySource,
    ToolsConfig,
    WorldConfig,
)
from rubricem_core.config.endpoints import EndpointConfig, JudgeConfig, TeacherConfig
from rubricem_core.config.eval import (
    EVAL_BENCHMARKS,
    EVAL_EXTRA_PATHS,
    EVAL_PROTOCOL_SETTINGS,
    EVAL_PROTOCOLS,
    BenchmarkGraderConfig,
    EvalConfig,
    EvalGraderConfig,
)
from rubricem_core.config.loading import (
    apply_overrides,
    config_keys,
    config_to_yaml,
    flatten,
    format_validation_error,
    load_config,
    nearest_key,
    parse_override,
    profile_path,
    require_env,
)
from rubricem_core.config.reflection import ReflectionConfig, ReflectionJudgeConfig
from rubricem_core.config.rollout import RolloutConfig
from rubricem_core.config.run import (
    REMOVED_DISTRIBUTED_KEYS,
    WORK_BOUNDS,
    DistributedConfig,
    RunConfig,
    TrackingConfig,
    bound_problems,
    token_budget_problems,
)
from rubricem_core.config.training import (
    REFLECTION_RECIPES,
    LoraSettings,
    PackingSettings,
    PolicyConfig,
    RLConfig,
    SFTConfig,
    TrainerSettings,
    trainer_default,
)
from rubricem_core.redact import MissingSecretError

__all__ = [
    "ALL_QUERY_KINDS",
    "BenchmarkGraderConfig",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "EVAL_BENCHMARKS",
    "EVAL_EXTRA_PATHS",
    "EVAL_PROTOCOLS",
    "EVAL_PROTOCOL_SETTINGS",
    "EndpointConfig",
    "EvalConfig",
    "EvalGraderConfig",
    "FilterConfig",
    "JudgeConfig",
    "LoraSettings",
    "MissingSecretError",
    "PROFILES_DIR",
    "PackingSettings",
    "PolicyConfig",
    "QueryKind",
    "QuerySource",
    "REFLECTION_RECIPES",
    "REMOVED_DISTRIBUTED_KEYS",
    "RLConfig",
    "ReflectionConfig",
    "ReflectionJudgeConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "TeacherConfig",
    "ToolsConfig",
    "TrackingConfig",
    "TrainerSettings",
    "WORK_BOUNDS",
    "WorldConfig",
    "apply_overrides",
    "bound_problems",
    "config_keys",
    "config_to_yaml",
    "flatten",
    "format_validation_error",
    "load_config",
    "nearest_key",
    "parse_override",
    "profile_path",
    "require_env",
    "token_budget_problems",
    "trainer_default",
]
