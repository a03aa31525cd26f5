"""Run config: profiles, overrides, clear errors, secrets from the environment only."""

from __future__ import annotations

import pytest

from rubricem_core.config import (
    ConfigError,
    MissingSecretError,
    RunConfig,
    config_to_yaml,
    load_config,
    parse_override,
    require_env,
)


@pytest.mark.parametrize("profile", ["tiny", "small", "learn", "gpu", "research", "research-drtulu"])
def test_builtin_profiles_load(profile):
    cfg = load_config(profile)
    assert isinstance(cfg, RunConfig)
    assert cfg.profile == profile


def test_overrides_change_nested_fields_and_parse_yaml_values():
    base = load_config("tiny")
    cfg = load_config("tiny", ["teacher.max_rounds=3", "data.world.n_documents=60", "tools.embedder=hashing"])
    assert cfg.teacher.max_rounds == 3 != base.teacher.max_rounds
    assert cfg.data.world.n_documents == 60
    assert cfg.tools.embedder == "hashing"
    # dict overrides (the flow parameter form) behave the same
    assert load_config("tiny", {"teacher.max_rounds": 3}).teacher.max_rounds == 3


def test_unknown_key_names_the_field_and_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("teacher:\n  max_roundz: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert "teacher.max_roundz" in str(err.value) and "unknown key" in str(err.value)
    assert str(bad) in str(err.value)


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("teacher.max_round=3", "did you mean teacher.max_rounds?"),
        ("rl.recipee=full", "did you mean rl.recipe?"),
        ("data.world.n_document=60", "did you mean data.world.n_documents?"),
        ("teachr.max_rounds=3", "did you mean teacher.max_rounds?"),  # a misspelt section, completed
        ("zzzzzz=1", None),  # nothing close: no guess
    ],
)
def test_unknown_override_key_gets_the_nearest_valid_key(override, suggestion):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [override])
    text = str(err.value)
    assert f"{override.split('=')[0].split('.')[0]}" in text and "unknown key" in text
    if suggestion is None:
        assert "did you mean" not in text
    else:
        assert suggestion in text


def test_wrong_type_is_reported_with_field():
    with pytest.raises(ConfigError, match=r"teacher\.max_rounds"):
        load_config("tiny", ["teacher.max_rounds=many"])


def test_unknown_profile_lists_known_ones():
    with pytest.raises(ConfigError, match="known profiles: .*tiny"):
        load_config("nope")


def test_malformed_yaml_and_override(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("teacher: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_config(bad)
    with pytest.raises(ConfigError, match="key.path=value"):
        parse_override("teacher.max_rounds")


def test_config_round_trips_through_yaml(tmp_path):
    cfg = load_config("tiny", ["seed=7"])
    path = tmp_path / "c.yaml"
    path.write_text(config_to_yaml(cfg))
    assert load_config(path) == cfg.model_copy(update={"profile": cfg.profile})


def test_secret_comes_from_env_and_missing_key_names_variable(monkeypatch):
    monkeypatch.delenv("RUBRICEM_TEST_KEY", raising=False)
    with pytest.raises(MissingSecretError, match="RUBRICEM_TEST_KEY"):
        require_env("RUBRICEM_TEST_KEY")
    monkeypatch.setenv("RUBRICEM_TEST_KEY", "sk-test")
    assert require_env("RUBRICEM_TEST_KEY") == "sk-test"


def test_gpu_profile_names_a_variable_not_a_key():
    cfg = load_config("gpu")
    assert cfg.teacher.api_key_env == "OPENAI_API_KEY"
    assert "sk-" not in config_to_yaml(cfg)


def test_research_profile_is_the_papers_settings_on_real_tools():
    """research: real data through --set only (no path under ../shared), web tools with their cache,
    litellm endpoints with named key variables, and the paper's / DR Tulu's settings."""
    from rubricem_core.tools.registry import KIND_ARGS

    cfg = load_config("research")
    text = config_to_yaml(cfg)
    assert "shared" not in text and "sk-" not in text
    assert cfg.data.source == "files" and cfg.data.queries == [] and cfg.data.corpus is None
    assert {s["kind"] for s in cfg.tools.specs} == {"gemini_google_search", "semantic_scholar", "web_browse"}
    assert {s["kind"] for s in cfg.tools.specs} <= set(KIND_ARGS)
    assert all(s["cache"] for s in cfg.tools.specs) and cfg.tools.cache_dir
    for endpoint in (cfg.teacher, cfg.judge, cfg.reflection.judge):  # the paper's Gemini families
        assert endpoint.api_key_env == "GEMINI_API_KEY" and endpoint.model.startswith("gemini/")
    assert cfg.eval.grader.api_key_env == "OPENAI_API_KEY" and not cfg.eval.grader.model.startswith("rubricem-")
    drtulu = load_config("research-drtulu")
    assert {s["kind"] for s in drtulu.tools.specs} == {"serper", "semantic_scholar", "web_browse"}
    for endpoint in (drtulu.teacher, drtulu.judge, drtulu.reflection.judge, drtulu.eval.grader):
        assert endpoint.api_key_env == "OPENAI_API_KEY" and endpoint.model.startswith("openai/")
    assert cfg.rollout.max_new_tokens == cfg.rollout.max_total_tokens  # only the total is capped
    assert (cfg.rl.lr, cfg.rl.warmup_steps, cfg.tools.max_tool_calls) == (5e-7, 0, 10)
    assert 2 * cfg.rl.window * cfg.rl.n_windows == 600
    assert cfg.reflection.judge.mode == "per_candidate" and "Qwen3-Embedding" in cfg.reflection.embedder
    # the user's files come in with --set
    given = load_config(
        "research", ["data.queries=[{path: q.jsonl, format: dr_tulu}]", "eval.paths.healthbench=h.jsonl"]
    )
    assert given.data.queries[0].format == "dr_tulu" and given.eval.paths == {"healthbench": "h.jsonl"}


def test_tool_specs_build_robust_tools(tmp_path):
    import pyarrow as pa

    from rubricem_core.environment import local_tool_env
    from rubricem_core.scaffold import ToolCall

    cfg = load_config(
        "tiny",
        {
            "tools.specs": [
                {"name": "search", "kind": "local_search", "timeout_s": 5, "cache": True},
                {"name": "browse", "kind": "local_browse"},
            ],
            "tools.cache_dir": str(tmp_path / "cache"),
        },
    )
    corpus = pa.table(
        {
            "doc_id": ["D1", "D2"],
            "title": ["Alpha", "Beta"],
            "text": ["Alpha Labs was founded in 1990.", "Beta Works employs 40 people."],
            "source": ["t", "t"],
        }
    )
    env = local_tool_env(corpus, cfg.tools)
    out = env.execute(ToolCall("search", "Alpha Labs founded"))
    assert 'id="D1"' in out.text
    assert "D2" in env.execute(ToolCall("browse", "D2")).text
    assert any((tmp_path / "cache").iterdir()), "cached tools write to the configured directory"
    with pytest.raises(Exception, match="kind"):
        local_tool_env(corpus, load_config("tiny", {"tools.specs": [{"name": "x", "kind": "nope"}]}).tools)


def test_a_web_tools_url_key_and_timeouts_may_change_after_collection(tmp_path):
    """tools.specs is compared per tool and argument: a moved search API, another key variable or other
    timeouts are recorded as a revision (as for an LLM endpoint); what shapes results is still refused."""
    import json

    from rubricem_core.run_config import record_config
    from rubricem_core.store import RunStore

    def research(**search):
        specs = [dict(s) for s in load_config("research").tools.specs]
        specs[0].update(search)
        return load_config("research", {"tools.specs": specs})

    run = tmp_path / "run"
    record_config(run, research(base_url="http://127.0.0.1:1"), "collect-sft-data")
    from rubricem_core.schemas import Query, queries_to_table

    query = Query("q", source="user", split="train", kind="long_form", question="why?", messages=[])
    RunStore(run).write_table("queries", queries_to_table([query]))  # collection has written: tools are fixed now
    moved = research(base_url="http://127.0.0.1:2", api_key_env="OTHER_KEY", timeout_s=90, max_concurrency=2)
    changes = {c.field for c in record_config(run, moved, "evaluate")}
    assert changes == {f"tools.specs.search.{k}" for k in ("base_url", "api_key_env", "timeout_s", "max_concurrency")}
    revision = json.loads((run / "state" / "config_revisions.jsonl").read_text().splitlines()[-1])
    assert revision["changes"]["tools.specs.search.base_url"] == {
        "old": "http://127.0.0.1:1",
        "new": "http://127.0.0.1:2",
    }
    with pytest.raises(ConfigError, match=r"tools\.specs\.search\.top_k: 8 → 3 .*collect-sft-data"):
        record_config(
            run,
            research(base_url="http://127.0.0.1:2", api_key_env="OTHER_KEY", timeout_s=90, max_concurrency=2, top_k=3),
            "evaluate",
        )
    fewer = load_config("research", {"tools.specs": moved.tools.specs[:1]})
    with pytest.raises(ConfigError, match=r"tools\.specs: \['search', 'paper_search', 'browse'\] → \['search'\]"):
        record_config(run, fewer, "evaluate")


@pytest.mark.parametrize(
    "key, value, why",
    [
        ("node_rank", 1, r"ray start --address"),
        ("master_addr", "10.0.0.5", r"tells them rank 0's address"),
        ("master_port", 29500, r"picks rank 0's port"),
        ("rdzv_backend", "c10d", r"no torchrun rendezvous"),
    ],
)
def test_the_torchrun_launch_keys_are_refused_pointing_to_the_ray_docs(tmp_path, key, value, why):
    with pytest.raises(ConfigError, match=rf"distributed\.{key} was removed: .*{why}.*docs/distributed\.md"):
        load_config("tiny", {f"distributed.{key}": value, "distributed.nproc_per_node": 2})
    profile = tmp_path / "old.yaml"  # an old profile file: the error names it
    profile.write_text(f"profile: old\ndistributed:\n  nproc_per_node: 2\n  {key}: {value}\n")
    with pytest.raises(ConfigError, match=rf"old\.yaml[\s\S]*distributed\.{key} was removed"):
        load_config(profile)


@pytest.mark.parametrize("address", ["auto", "ray://head:10001", None])
def test_ray_address_joins_a_cluster_or_falls_back_to_the_environment(monkeypatch, address):
    from rubricem_core.distributed.cluster import cluster_address

    cfg = load_config("tiny", {"distributed.ray_address": address, "distributed.nproc_per_node": 2})
    assert cfg.distributed.ray_address == address and cfg.distributed.world_size == 2
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster_address(cfg.distributed) == address  # None: a local Ray
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
    assert cluster_address(cfg.distributed) == (address or "10.0.0.9:6379")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"rollout.weight_transfer": "gloo"}, r"rollout[\s\S]*weight_transfer: gloo[\s\S]*engine: vllm_server"),
        ({"rollout.colocate": True}, r"rollout[\s\S]*colocate[\s\S]*engine: vllm_server"),
        (
            {"rollout.engine": "vllm_server", "rollout.colocate": True, "rl.recipe": "full"},
            r"reflection\.schedule: sync",
        ),
        (
            {
                "rollout.engine": "vllm_server",
                "rollout.colocate": True,
                "distributed.nnodes": 2,
            },
            r"distributed\.nnodes: 1",
        ),
        (
            {"rollout.engine": "vllm_server", "rollout.colocate": True, "rollout.weight_transfer": "nccl"},
            r"weight_transfer: checkpoint when colocated",
        ),
    ],
    ids=["push-needs-server", "colocate-needs-server", "colocate-not-deferred", "colocate-one-node", "colocate-nccl"],
)
def test_engine_placement_settings_are_checked_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides=overrides)


def test_colocation_and_weight_push_load_where_they_fit():
    cfg = load_config(
        "tiny",
        overrides={
            "rollout.engine": "vllm_server",
            "rollout.weight_transfer": "gloo",
            "rollout.colocate": True,
            "rl.recipe": "full",
            "reflection.schedule": "sync",
        },
    )
    assert cfg.rollout.colocate and cfg.rollout.weight_transfer == "gloo"
    separate = load_config("tiny", overrides={"rollout.engine": "vllm_server", "rollout.weight_transfer": "nccl"})
    assert separate.rollout.weight_transfer == "nccl" and not separate.rollout.colocate


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"rollout.replicas": 2}, r"rollout[\s\S]*replicas: 2 needs engine: vllm_server"),
        ({"rollout.schedule": "async"}, r"rollout[\s\S]*schedule: async needs engine: vllm_server"),
        ({"rollout.replicas": 0}, r"rollout\.replicas"),
        (
            {"rollout.engine": "vllm_server", "rollout.replicas": 2, "rollout.devices": [0, 1, 2]},
            r"devices: \[0, 1, 2\] must list 2 distinct devices for replicas: 2",
        ),
        (
            {
                "rollout.engine": "vllm_server",
                "rollout.replicas": 2,
                "rollout.tensor_parallel_size": 2,
                "rollout.devices": [0, 1, 2, 2],
            },
            r"must list 4 distinct devices",
        ),
        ({"rollout.engine": "vllm_server", "rollout.max_concurrent_tool_calls": 0}, r"max_concurrent_tool_calls"),
    ],
    ids=["replicas-need-server", "async-needs-server", "no-replica", "short-split", "device-twice", "no-tool-slot"],
)
def test_fleet_settings_are_checked_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides=overrides)


def test_fleet_settings_load_where_they_fit():
    from rubricem_core.rollout.vllm_fleet import split_devices

    cfg = load_config(
        "tiny",
        overrides={
            "rollout.engine": "vllm_server",
            "rollout.replicas": 2,
            "rollout.tensor_parallel_size": 2,
            "rollout.devices": [4, 5, 6, 7],
            "rollout.schedule": "lockstep",
        },
    )
    assert cfg.rollout.schedule == "lockstep"
    assert split_devices(cfg.rollout.devices, 2, 2) == [[4, 5], [6, 7]]
    assert split_devices(None, 3, 2) == [None, None, None]  # CPUs: every replica sees them all
    assert split_devices([0, 1, 2], 1, 1) == [[0, 1, 2]]  # one server takes what it is given (colocated)
    assert load_config("tiny").rollout.schedule is None  # the engine's own: async on a vllm_server


def test_reflection_recipes_listed_in_the_config_are_the_recipes_with_reflection():
    from rubricem_core.config import REFLECTION_RECIPES
    from rubricem_core.recipes import RECIPES

    assert set(REFLECTION_RECIPES) == {name for name, r in RECIPES.items() if r.reflection}


# ---------------------------------------------------------------- trainer settings (sft and rl share them)
# each TrainerSettings key with a value that differs from both sections' defaults
TRAINER_OVERRIDES = {
    "lr": 0.05,
    "weight_decay": 0.1,
    "warmup_steps": 2,
    "min_lr_ratio": 0.5,
    "max_grad_norm": 0.5,
    "precision": "bf16",
    "gradient_checkpointing": True,
}
DEEPSPEED_OVERRIDES = {"backend": "deepspeed", "zero_stage": 3, "offload": True, "offload_params": True}


def trainer_config_of(cfg: RunConfig, section: str):
    """The TrainerConfig the section's trainer is built with, through the function its stage calls."""
    if section == "sft":
        from rubricem_core.sft import trainer_config

        return trainer_config(cfg.sft, total_steps=100, seed=cfg.seed)
    from rubricem_core.rl.policy import rl_trainer_config

    return rl_trainer_config(cfg)


def test_trainer_settings_cover_every_training_key_with_help():
    from rubricem_core.config import TrainerSettings

    assert set(TRAINER_OVERRIDES) | set(DEEPSPEED_OVERRIDES) == set(TrainerSettings.model_fields)
    assert all(field.description for field in TrainerSettings.model_fields.values())


@pytest.mark.parametrize("section", ["sft", "rl"])
def test_trainer_settings_are_one_declaration_in_both_sections(section):
    from rubricem_core.config import TrainerSettings
    from rubricem_core.training import TrainerConfig

    fields = RunConfig.model_fields[section].annotation.model_fields
    for name, shared in TrainerSettings.model_fields.items():
        # the same help text and checks (a section may only change the default), and the trainer reads them too
        assert fields[name].description == shared.description == TrainerConfig.model_fields[name].description
        assert fields[name].metadata == shared.metadata


@pytest.mark.parametrize("section", ["sft", "rl"])
@pytest.mark.parametrize("overrides", [TRAINER_OVERRIDES, DEEPSPEED_OVERRIDES], ids=["optimizer", "deepspeed"])
def test_flat_trainer_keys_reach_the_trainer(section, overrides):
    base = trainer_config_of(load_config("tiny"), section)
    cfg = load_config("tiny", [f"{section}.{key}={str(value).lower()}" for key, value in overrides.items()])
    trainer = trainer_config_of(cfg, section)
    for key, value in overrides.items():
        assert getattr(getattr(cfg, section), key) == value, key
        if not (section == "sft" and key == "warmup_steps"):  # sft shortens warm-up to fit a short run
            assert getattr(trainer, key) == value != getattr(base, key), key
    # the run's own numbers come from the run, not the section
    assert trainer.seed == cfg.seed and trainer.total_steps >= 1


@pytest.mark.parametrize("section", ["sft", "rl"])
@pytest.mark.parametrize(
    "overrides, field",
    [
        (["backend=torch", "offload=true"], "offload"),
        (["backend=deepspeed", "zero_stage=0", "offload=true"], "offload"),
        (["backend=deepspeed", "zero_stage=2", "offload_params=true"], "offload_params"),
        (["lr=0"], "lr"),
        (["max_grad_norm=-1"], "max_grad_norm"),
        (["min_lr_ratio=1.5"], "min_lr_ratio"),
        (["precision=fp16"], "precision"),
    ],
)
def test_bad_trainer_settings_are_rejected_naming_the_key(section, overrides, field):
    with pytest.raises(ConfigError, match=rf"{section}\b.*{field}"):
        load_config("tiny", [f"{section}.{item}" for item in overrides])


@pytest.mark.parametrize(
    "section, defaults",
    [
        # the sections' own defaults (what the trainers got before the settings were shared)
        ("sft", {"lr": 3e-3, "warmup_steps": 10, "weight_decay": 0.0, "min_lr_ratio": 0.1, "max_grad_norm": 1.0}),
        ("rl", {"lr": 2e-4, "warmup_steps": 0, "weight_decay": 0.0, "min_lr_ratio": 1.0, "max_grad_norm": 1.0}),
    ],
)
def test_each_section_keeps_its_trainer_defaults(section, defaults):
    section_cfg = RunConfig.model_fields[section].annotation()
    assert {key: getattr(section_cfg, key) for key in defaults} == defaults


def test_a_profile_name_is_looked_up_in_the_profiles_even_beside_a_folder_of_that_name(tmp_path, monkeypatch):
    (tmp_path / "tiny").mkdir()  # what runs/ holds after `make run`
    (tmp_path / "mine.yaml").write_text("seed: 7\n")
    monkeypatch.chdir(tmp_path)
    assert load_config("tiny").profile == "tiny"
    assert load_config("mine.yaml").seed == 7
    assert load_config("./mine.yaml").seed == 7
    with pytest.raises(ConfigError, match="profile file not found"):
        load_config("./tiny")  # a path names a file, and this one is a folder
    with pytest.raises(ConfigError, match="unknown profile 'mine'"):
        load_config("mine")


@pytest.mark.parametrize(
    "key, value",
    [("rl.queries_per_step", 10**20), ("distributed.nproc_per_node", 1000), ("judge.max_concurrency", 10**6)],
)
def test_a_size_past_its_bound_is_refused_naming_the_bound_and_why(key, value):
    from rubricem_core.config import WORK_BOUNDS

    with pytest.raises(ConfigError) as err:
        load_config("tiny", {key: value})
    bound, why = WORK_BOUNDS[key]
    assert f"{key}: {value:g} is over its bound {bound:,} ({why})" in str(err.value)
    assert "<root>" not in str(err.value)
    assert load_config("tiny", {key: bound})  # the bound itself is allowed


@pytest.mark.parametrize("value", ["sk-abc123", "sk-proj-x", "gsk_short", "OPENAI_KEY", "my block", "a" * 101])
def test_a_secret_block_field_takes_only_a_block_name_and_never_echoes_the_value(value):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", {"judge.api_key_secret_block": value})
    assert "must name a Prefect Secret block" in str(err.value)
    if value.startswith(("sk", "gsk")):
        assert value not in str(err.value)


def test_a_secret_block_name_is_accepted():
    assert load_config("gpu").teacher.api_key_secret_block == "openai-api-key"
    assert (
        load_config("tiny", {"judge.api_key_secret_block": "judge-key-2"}).judge.api_key_secret_block == "judge-key-2"
    )


def test_a_profile_extends_its_base_section_by_section(tmp_path):
    from rubricem_core.testing import MICRO_PROFILE

    child = tmp_path / "child.yaml"
    child.write_text("base: tiny\nrl:\n  window: 3\npolicy:\n  hidden_size: 96\n")
    grandchild = tmp_path / "grandchild.yaml"
    grandchild.write_text("base: child.yaml\nrl:\n  recipe: baseline\n")
    tiny, got = load_config("tiny"), load_config(grandchild)
    assert got.profile == "grandchild"
    assert (got.rl.window, got.rl.recipe, got.policy.hidden_size) == (3, "baseline", 96)
    # every other key of the touched sections, and every other section, is the base's
    assert got.rl.n_windows == tiny.rl.n_windows and got.policy.n_layers == tiny.policy.n_layers
    assert got.teacher == tiny.teacher and got.judge == tiny.judge
    micro = load_config(MICRO_PROFILE, {"rl.recipe": "ss_grpo"})  # overrides apply over the merged profile
    assert (micro.profile, micro.policy.hidden_size, micro.rl.recipe) == ("micro", 64, "ss_grpo")


@pytest.mark.parametrize(
    "text, message",
    [
        ("base: nosuch\n", "unknown profile 'nosuch'"),
        ("base: missing.yaml\n", "profile file not found"),
        ("base: [tiny]\n", "base must name a profile"),
        ("base: self.yaml\n", "cycle"),
    ],
)
def test_a_bad_base_is_named(tmp_path, text, message):
    path = tmp_path / "self.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)
