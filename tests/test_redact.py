"""Keys are refused where they do not belong and never shown; credentials in URLs never recorded.

Each test here fails without its fix (rubricem_core/redact.py and its uses): a key pasted into
``api_key_env`` was accepted, a refused ``--set`` printed the key back, ``config.yaml``, MLflow params and
error texts carried an ``api_base``'s password. tests/test_fault_secrets.py searches a whole run.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rubricem_core import redact
from rubricem_core.config import ConfigError, MissingSecretError, config_to_yaml, flatten, load_config
from rubricem_core.llm.concurrent import error_text
from rubricem_core.llm.endpoints import endpoint_settings
from rubricem_core.redact import is_env_var_name, redact_text
from rubricem_core.run_config import stored_config

REPO = Path(__file__).resolve().parents[1]


def _key() -> str:
    return f"sk-proj-{secrets.token_hex(20)}"


@pytest.mark.parametrize(
    "pasted",
    [
        "sk-proj-{hex}",  # OpenAI
        "hf_{hex}Ab",  # Hugging Face: a valid variable name, but a token
        "gsk_{hex}",  # Groq
        "k{hex}",  # a bare random key: letters and digits
        "my key {hex}",  # spaces
        "OPENAI-API-KEY",  # a dash: no variable can be named so
    ],
)
@pytest.mark.parametrize("section", ["judge", "teacher", "eval.grader"])
def test_a_key_in_api_key_env_is_refused_without_echo(pasted, section):
    value = pasted.format(hex=secrets.token_hex(12))
    with pytest.raises(ConfigError) as err:
        load_config("tiny", {f"{section}.api_key_env": value})
    message = str(err.value)
    assert f"{section}.api_key_env" in message and "environment variable" in message
    assert value not in message and value[-12:] not in message


@pytest.mark.parametrize("name", ["OPENAI_API_KEY", "RUBRICEM_JUDGE_KEY_2", "_private", "azure_api_key"])
def test_a_variable_name_is_accepted(name):
    assert is_env_var_name(name)
    assert load_config("tiny", {"judge.api_key_env": name}).judge.api_key_env == name


def test_a_key_in_a_tool_spec_is_refused_without_echo():
    key = _key()
    for spec in ({"api_key": key}, {"api_key_env": key}):
        with pytest.raises(ConfigError) as err:
            load_config("tiny", {"tools.specs": [{"name": "search", "kind": "serper", **spec}]})
        assert "tools.specs" in str(err.value) and key not in str(err.value) and key[-12:] not in str(err.value)


@pytest.mark.parametrize(
    "override",
    [
        "judge.api_key={key}",  # unknown key, named as a secret
        "judge.api_key_env={key}",  # refused: not a variable name
        "judge.max_retries={key}",  # refused: not an int, the value looks like a key
        "judge.token=[{key}",  # not valid YAML
        "{key}",  # no key=value at all
    ],
)
def test_a_refused_override_never_prints_the_key(tmp_path, override):
    key = _key()
    item = override.format(key=key)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--run-dir", str(tmp_path / "run"), "--set", item],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert key not in output and key[-12:] not in output, output
    assert "error" in output and (item.split("=", 1)[0] in output or "=" not in item), output


def test_an_unknown_key_field_points_at_api_key_env():
    with pytest.raises(ConfigError, match=r"judge\.api_key: unknown key .*judge\.api_key_env"):
        load_config("tiny", {"judge.api_key": _key()})


def test_a_recorded_config_with_a_key_is_refused_without_echo(tmp_path):
    key = _key()
    (tmp_path / "config.yaml").write_text(
        config_to_yaml(load_config("tiny")).replace("api_key_env: null", f"api_key_env: {key}", 1)
    )
    with pytest.raises(ConfigError) as err:
        stored_config(tmp_path)
    assert "api_key_env" in str(err.value) and key not in str(err.value)


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("https://bob:{pw}@example.com/v1", "https://bob:***@example.com/v1"),
        ("http://bob:{pw}@127.0.0.1:8000/v1?x=1", "http://bob:***@127.0.0.1:8000/v1?x=1"),
        ("https://example.com/v1?api_key={pw}&x=1", "https://example.com/v1?api_key=***&x=1"),
        ("https://ghp_{pw}@github.com/o/r", "https://***@github.com/o/r"),
    ],
)
def test_api_base_credentials_are_held_not_recorded(monkeypatch, url, masked):
    monkeypatch.setattr(redact, "_HELD", {})
    password = secrets.token_hex(16)
    real = url.format(pw=password)
    cfg = load_config("tiny", {"judge.model": "openai/judge", "judge.api_base": real})
    # what every record is made from: config.yaml, MLflow params, Prefect parameters, launch files
    assert cfg.judge.api_base == masked
    assert password not in config_to_yaml(cfg) and password not in str(flatten(cfg.model_dump(mode="json")))
    assert masked in config_to_yaml(cfg)
    # the endpoint of this process calls the real URL, and does not print it
    settings = endpoint_settings(cfg.judge)
    assert settings.api_base == real and password not in repr(settings)
    # another process reading the recorded config back is told to give the URL again
    recorded = yaml.safe_load(config_to_yaml(cfg))
    monkeypatch.setattr(redact, "_HELD", {})
    again = load_config("tiny", {"judge.model": "openai/judge", "judge.api_base": recorded["judge"]["api_base"]})
    with pytest.raises(MissingSecretError, match=r"credentials masked .*api_base"):
        endpoint_settings(again.judge)


def test_a_credentialed_override_is_masked_when_parsed(monkeypatch):
    """The CLI makes Prefect's flow-run parameters from the parsed overrides."""
    from rubricem_core.config import parse_override

    monkeypatch.setattr(redact, "_HELD", {})
    key, value = parse_override("judge.api_base=https://bob:hunter2hunter2@example.com/v1")
    assert (key, value) == ("judge.api_base", "https://bob:***@example.com/v1")
    assert load_config("tiny", {key: value, "judge.model": "openai/j"}).judge.api_base == value
    assert (
        "hunter2hunter2"
        in endpoint_settings(load_config("tiny", {key: value, "judge.model": "openai/j"}).judge).api_base
    )


def test_error_texts_mask_url_credentials():
    from rubricem_core.llm.types import EndpointSettings

    base = "http://bob:s3cretpassw0rd@127.0.0.1:9/v1"
    settings = EndpointSettings(model="openai/m", api_base=base, api_key="sk-the-key")
    exc = ConnectionError(f"cannot connect to {base}/chat/completions with sk-the-key")
    text = error_text(exc, settings)
    assert "s3cretpassw0rd" not in text and "sk-the-key" not in text and "bob:***@127.0.0.1:9" in text


def test_tracked_params_mask_url_credentials(tmp_path):
    from rubricem_core.tracking import Tracker

    tracker = Tracker(tmp_path / "run")
    with tracker.child_run("collect_sft_data", params={"tools.specs": [{"base_url": "https://u:pw1234567@h/x"}]}):
        pass
    data = b"".join(p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file())
    assert b"pw1234567" not in data and b"u:***@h" in data


def test_web_tool_base_url_credentials_stay_out_of_the_fingerprint(monkeypatch):
    from rubricem_core.tools.registry import build_tools

    monkeypatch.setattr(redact, "_HELD", {})
    monkeypatch.setenv("RUBRICEM_T_SERPER", "k")
    spec = {"name": "search", "kind": "serper", "api_key_env": "RUBRICEM_T_SERPER", "base_url": "https://u:pw98765@h"}
    cfg = load_config("tiny", {"tools.specs": [spec]})
    assert cfg.tools.specs[0]["base_url"] == "https://u:***@h"
    tool = build_tools(cfg.tools.specs)["search"]
    inner = tool.inner
    assert inner.base_url == "https://u:pw98765@h" and "pw98765" not in inner.fingerprint


@pytest.mark.parametrize(
    "text",
    ["plain text", "https://example.com/v1?top_k=5", "https://bob@example.com/", "cost_per_token=3", "s3://bucket/x"],
)
def test_redact_text_leaves_what_is_not_a_credential(text):
    assert redact_text(text) == text


def test_a_refused_config_change_never_prints_a_key_like_value(tmp_path):
    from rubricem_core.run_config import record_config
    from rubricem_core.store import RunStore

    run = tmp_path / "run"
    record_config(run, load_config("tiny"), "collect-sft-data")
    from rubricem_core.schemas import Query, queries_to_table

    query = Query("q", source="user", split="train", kind="long_form", question="why?", messages=[])
    RunStore(run).write_table("queries", queries_to_table([query]))  # collection has written: tools are fixed now
    key = _key()
    with pytest.raises(ConfigError, match=r"tools\.embedder: None → <value not shown>") as err:
        record_config(run, load_config("tiny", {"tools.embedder": key}), "collect-sft-data")
    assert key not in str(err.value)


@pytest.mark.parametrize(
    "env",
    [
        {"HF_TOKEN": "x"},
        {"VLLM_API_KEY": "x"},
        {"SOME_SETTING": "hf_{hex}"},
        {"DATABASE_URL": "postgres://u:pw{hex}@db/x"},  # a URL's password, whatever the variable's name
    ],
)
def test_a_secret_in_server_env_is_refused_without_echo(env):
    env = {k: v.format(hex=secrets.token_hex(12)) for k, v in env.items()}
    with pytest.raises(ConfigError) as err:
        load_config("tiny", {"rollout.server_env": env})
    assert "rollout.server_env" in str(err.value)
    assert all(v not in str(err.value) for v in env.values() if len(v) > 1)


def test_server_env_settings_are_accepted():
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "NCCL_DEBUG": "INFO", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert load_config("tiny", {"rollout.server_env": env}).rollout.server_env == env
