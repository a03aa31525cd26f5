"""What several benchmark scripts share."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NamedTuple

from rubricem_core.layout import RunLayout


def has_sft_checkpoint(run_dir: Path, na_figure: str) -> bool:
    """True when ``run_dir`` holds checkpoints/sft/final; otherwise prints how to get one and the
    script's figure line marked n/a (run_all still finds a last line to parse)."""
    if RunLayout(run_dir).has_sft_policy():
        return True
    print(f"no SFT checkpoint under {run_dir}: run `make run` (or pass --run-dir)")
    print(na_figure)
    return False


def add_set_argument(parser: argparse.ArgumentParser, help: str = "config override (YAML value; repeatable)") -> None:
    """``--set KEY=VALUE`` (repeatable) into ``args.overrides``; parse_overrides reads them."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``--set`` items as the dotted overrides load_config takes (YAML values)."""
    from rubricem_core.config import parse_override

    return dict(parse_override(item) for item in items)


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: steadiest on a shared machine, where spinning threads stall)",
    )


def rollout_requests(tokenizer: Any, queries: list[dict[str, Any]], cfg: Any, n: int, sampling: Any) -> list[Any]:
    """One request of ``n`` samples per query row, prompted as the run prompts (its prompt style, no guidance)
    and with its tool budget."""
    from rubricem_core.encoding import encode_prompt
    from rubricem_core.environment import prompt_messages
    from rubricem_core.rollout import RolloutRequest

    return [
        RolloutRequest(
            request_id=q["query_id"],
            prompt_ids=encode_prompt(tokenizer, prompt_messages(q, style=cfg.policy.prompt_style)),
            n=n,
            sampling=sampling,
            max_tool_calls=cfg.tools.max_tool_calls,
        )
        for q in queries
    ]


def fake_judge_settings(server: Any, api_key: str, concurrency: int) -> Any:
    """The LLM judge's endpoint on a bench's fake OpenAI server: no retries (the fake does not fail), 120 s a call."""
    from rubricem_core.llm.types import EndpointSettings

    return EndpointSettings(
        model="openai/judge",
        api_base=server.base_url,
        api_key=api_key,
        max_concurrency=concurrency,
        max_retries=0,
        timeout_s=120,
    )


class HeldOutSampling(NamedTuple):
    """What a bench that samples a checkpoint on a run's held-out queries starts from."""

    store: Any  # the run's RunStore
    cfg: Any  # the run's RunConfig
    checkpoint: str
    model: Any
    tokenizer: Any
    queries: list[dict[str, Any]]  # the first max_queries eval-split query rows
    env: Any  # the run's local tool environment


def held_out_sampling(run_dir: str, checkpoint: str | None, max_queries: int) -> HeldOutSampling:
    """The run's store and config, ``checkpoint``'s policy (default: the run's SFT policy), its first
    ``max_queries`` held-out queries and its tools."""
    from rubricem_core.config import load_config
    from rubricem_core.environment import local_tool_env
    from rubricem_core.policy.loading import load_policy
    from rubricem_core.store import RunStore

    store = RunStore(run_dir)
    cfg = load_config(RunLayout(run_dir).config_file)
    checkpoint = checkpoint or str(RunLayout(run_dir).sft_final)
    model, tokenizer = load_policy(checkpoint)
    queries = [q for q in store.read_rows("queries") if q["split"] == "eval"][:max_queries]
    env = local_tool_env(store.read_table("corpus"), cfg.tools)
    return HeldOutSampling(store, cfg, checkpoint, model, tokenizer, queries, env)
