"""A CPU fleet sized before it starts (rollout/memory_plan.py), a dead replica's root cause named, and one
reload source per checkpoint however many replicas reload it at once (issue #48, item 7)."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest

from rubricem_core.rollout.memory_plan import (
    GIB,
    RUNTIME_BYTES,
    TRAINER_BYTES_PER_PARAM,
    kv_bytes_per_token,
    param_count,
    plan_cpu_fleet,
)
from rubricem_core.rollout.types import RolloutError
from rubricem_core.rollout.vllm_server import RELOAD_READY, reload_source, root_cause
from rubricem_core.sim.tiny_policy import TinyPolicySpec, build_tiny_policy
from tests.threads import run_in_threads

SPEC = TinyPolicySpec(vocab_size=600, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return Path(build_tiny_policy(["words for a tokenizer"] * 20, tmp_path_factory.mktemp("m") / "policy", SPEC))


def test_kv_bytes_per_token_worked_by_hand():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims; keys and values, bf16 = 2 · 30 · 3 · 64 · 2 bytes
    smollm2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert kv_bytes_per_token(smollm2, "bfloat16") == 23_040
    assert kv_bytes_per_token(smollm2, "float32") == 46_080  # small.yaml's "46 KB a token"
    assert kv_bytes_per_token({**smollm2, "num_key_value_heads": None}, "float32") == 3 * 46_080


def test_param_count_reads_the_headers(model):
    from safetensors.torch import load_file

    tensors = load_file(str(model / "model.safetensors"))
    assert param_count(model) == sum(t.numel() for t in tensors.values()) > 0


def test_the_cache_is_what_the_calls_fill_within_an_equal_share(model):
    config = json.loads((model / "config.json").read_text())
    per_token = kv_bytes_per_token(config, "float32")
    weights = (model / "model.safetensors").stat().st_size
    # 64 calls of 1M tokens need more than the machine has: each of 2 replicas gets its share, in whole GiB
    big = dict(replicas=2, max_model_len=2**20, max_sequences=64, dtype="float32")
    plan = plan_cpu_fleet(model, **big, available_bytes=24 * GIB, trainer_params=10**8)
    share = (24 * GIB - TRAINER_BYTES_PER_PARAM * 10**8 - 2 * (weights + RUNTIME_BYTES)) // 2
    assert plan.kv_cache_gib == share // GIB and not plan.given
    assert plan.kv_needed_bytes == 64 * 2**20 * per_token > 24 * GIB
    # few short calls: what they fill, rounded up to a GiB, however much is free
    small = plan_cpu_fleet(
        model, replicas=2, max_model_len=512, max_sequences=4, dtype="float32", available_bytes=24 * GIB
    )
    assert small.kv_cache_gib == math.ceil(4 * 512 * per_token / GIB) == 1
    assert "2 vLLM replica(s) × (1 GiB KV cache, derived" in small.describe()


def test_a_layout_that_cannot_fit_is_refused_with_its_numbers(model):
    with pytest.raises(RolloutError, match=r"does not fit in memory: 4 vLLM replica\(s\).*of 3\.0 GiB available"):
        plan_cpu_fleet(model, replicas=4, max_model_len=512, max_sequences=4, dtype="float32", available_bytes=3 * GIB)
    # one sequence needs more than a replica's share
    with pytest.raises(RolloutError, match="at least one sequence's KV cache"):
        plan_cpu_fleet(
            model, replicas=2, max_model_len=10**7, max_sequences=1, dtype="float32", available_bytes=8 * GIB
        )


def test_a_given_size_is_kept_and_refused_when_the_replicas_cannot_hold_it(model):
    kept = plan_cpu_fleet(
        model, replicas=1, max_model_len=512, max_sequences=4, dtype="bfloat16", available_bytes=8 * GIB, kv_cache_gib=4
    )
    assert kept.kv_cache_gib == 4 and kept.given and "4 GiB KV cache, VLLM_CPU_KVCACHE_SPACE given" in kept.describe()
    with pytest.raises(RolloutError, match="lower VLLM_CPU_KVCACHE_SPACE"):
        plan_cpu_fleet(
            model,
            replicas=2,
            max_model_len=512,
            max_sequences=4,
            dtype="bfloat16",
            available_bytes=8 * GIB,
            kv_cache_gib=4,
        )


@pytest.mark.parametrize(
    ("tail", "code", "cause"),
    [
        ("INFO starting\nRuntimeError: CPU out of memory. Tried to allocate 12 GiB", 1, "out of memory: RuntimeError"),
        ("ERROR [Errno 98] error while attempting to bind: Address already in use", 1, "its port is taken"),
        ("Traceback\nModuleNotFoundError: No module named 'vllm'", 1, "a module is missing"),
        ("INFO loading weights", -9, "killed by SIGKILL, most likely the kernel's out-of-memory killer"),
        ("Traceback\nValueError: max_model_len 9000 is larger than the model's 8192", 1, "ValueError: max_model_len"),
        ("INFO nothing useful", 1, None),
    ],
)
def test_a_dead_servers_root_cause_is_named(tail, code, cause):
    found = root_cause(tail, code)
    assert found == cause if cause is None else found.startswith(cause)


def test_replicas_reloading_one_checkpoint_share_one_reload_source(tmp_path):
    spec = TinyPolicySpec(vocab_size=600, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=64)
    step = Path(build_tiny_policy(["words for a tokenizer"] * 20, tmp_path / "step-000003", spec))
    config = json.loads((step / "config.json").read_text())
    (step / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    (tmp_path / ".step-000003.vllm-reload").mkdir()  # half-built by a process that died
    barrier = threading.Barrier(4)
    found: list[Path] = []
    errors: list[BaseException] = []

    def replica() -> None:
        try:
            barrier.wait()
            found.append(reload_source(step))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    run_in_threads(lambda _: replica(), 4)
    assert not errors, errors
    side = tmp_path / ".step-000003.vllm-reload"
    assert found == [side] * 4 and (side / RELOAD_READY).is_file()
    assert sorted(p.name for p in side.iterdir()) == sorted(
        [RELOAD_READY, "config.json", "lm_head.safetensors", "model.safetensors"]
    )
    assert [p.name for p in tmp_path.iterdir() if ".vllm-reload." in p.name] == []  # no staging left behind
    from safetensors.torch import load_file

    head = load_file(str(side / "lm_head.safetensors"))["lm_head.weight"]
    assert head.equal(load_file(str(step / "model.safetensors"))["model.embed_tokens.weight"])
    (step / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    assert reload_source(step) == step.resolve()  # untied: the checkpoint itself


def test_the_fleet_env_carries_the_planned_size(model):
    from rubricem_core.config import load_config
    from rubricem_core.rollout.factory import cpu_fleet_env

    cfg = load_config(
        "tiny",
        {"rollout.engine": "vllm_server", "rollout.replicas": 2, "rollout.server_env": {"VLLM_HOST_IP": "127.0.0.1"}},
    )
    env = cpu_fleet_env(cfg, model, push=True)
    assert env == {"VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": env["VLLM_CPU_KVCACHE_SPACE"]}
    assert int(env["VLLM_CPU_KVCACHE_SPACE"]) >= 1
    given = load_config("tiny", {"rollout.server_env": {"VLLM_CPU_KVCACHE_SPACE": "1"}})
    assert cpu_fleet_env(given, model, push=False)["VLLM_CPU_KVCACHE_SPACE"] == "1"
