"""Where every file of one run directory lives: the one place that spells the run-directory layout.

    <run_dir>/
      config.yaml                          the resolved RunConfig of the run (rubricem_core.run_config)
      .rubricem.lock                       the writer lock (rubricem_core.runlock)
      tables/<table>/...                   Parquet tables (rubricem_core.store)
      state/                               small state files of the loops:
        bank/                                the saved reflection bank (RL writes, evaluation reads)
        task_metrics/<task>-<step>.json      a step task's metrics, for a rerun that skips the task
        rl_progress.json                     the last completed RL step
        config_revisions.jsonl               accepted config changes
        mlflow_parent.json                   the run directory's MLflow parent run
        <name>.json                          batch markers (a submitted teacher batch to re-attach to)
        launch/                              multi-node launch specs
        prefect-server.log                   the CLI's ephemeral Prefect server
      mlflow/mlflow.db, mlflow/artifacts/  SQLite tracking store and its artifacts
      policy/base/                         the base policy built for the run (the tiny profile)
      checkpoints/sft/step-NNNNNN, final   SFT checkpoints (final: the policy RL starts from)
      checkpoints/rl/step-NNNNNN           one checkpoint per RL step
      report/report.html                   the one-page HTML report
      ablation/<recipe>/, ablation.png,    the ablation flow's sub runs, its plot and, with rl.eval_every,
      ablation_curve.png                   its learning curves

A ``RunLayout`` never resolves or creates anything: it joins names onto the path it is given, so each
caller keeps its own choice of a resolved or a relative run directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CONFIG_FILE = "config.yaml"
LOCK_FILE = ".rubricem.lock"
TABLES_DIR = "tables"
STATE_DIR = "state"
MLFLOW_DIR = "mlflow"
CHECKPOINTS_DIR = "checkpoints"
REPORT_DIR = "report"
POLICY_DIR = "policy"
ABLATION_DIR = "ablation"

BANK_DIR = "bank"
TASK_METRICS_DIR = "task_metrics"
RL_PROGRESS_FILE = "rl_progress.json"
CONFIG_REVISIONS_FILE = "config_revisions.jsonl"
TRACKING_STATE_FILE = "mlflow_parent.json"
PREFECT_SERVER_LOG = "prefect-server.log"
RANK_LOGS_DIR = "ranks"
MLFLOW_DB = "mlflow.db"
MLFLOW_ARTIFACTS_DIR = "artifacts"
REPORT_FILE = "report.html"
ABLATION_PLOT = "ablation.png"
ABLATION_CURVE_PLOT = "ablation_curve.png"

FINAL_CHECKPOINT = "final"
STEP_CHECKPOINT = re.compile(r"step-\d+")  # the name of an intermediate checkpoint directory


def step_checkpoint_name(step: int) -> str:
    """``step-000003``: six digits, so the names sort by step."""
    return f"step-{step:06d}"


def step_checkpoint_dir(checkpoint_root: str | os.PathLike[str], step: int) -> Path:
    """An intermediate checkpoint under a trainer's checkpoint root (SFT's, or the RL steps')."""
    return Path(checkpoint_root) / step_checkpoint_name(step)


def final_checkpoint_dir(checkpoint_root: str | os.PathLike[str]) -> Path:
    """The finished checkpoint under a trainer's checkpoint root."""
    return Path(checkpoint_root) / FINAL_CHECKPOINT


def holds_policy(directory: Path) -> bool:
    """Whether ``directory`` holds a policy: a Hugging Face model (``config.json``) or a LoRA adapter over a
    base it names (``adapter_config.json``, training/adapters.py); both are written last-renamed, whole."""
    return (directory / "config.json").exists() or (directory / "adapter_config.json").exists()


class RunLayout:
    """Every path of one run directory (see the module doc for the tree)."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.root = Path(run_dir)

    def __repr__(self) -> str:
        return f"RunLayout({str(self.root)!r})"

    # ---- top level ---------------------------------------------------------------------------------
    @property
    def config_file(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def lock_file(self) -> Path:
        return self.root / LOCK_FILE

    @property
    def tables_dir(self) -> Path:
        return self.root / TABLES_DIR

    def table_dir(self, table: str) -> Path:
        """``tables/<table>``; the name is not checked here (RunStore.table_dir checks it)."""
        return self.tables_dir / table

    # ---- state/ ------------------------------------------------------------------------------------
    @property
    def state_dir(self) -> Path:
        return self.root / STATE_DIR

    def eval_queries_file(self, part_name: str) -> Path:
        """The query ids an `eval_results` part was evaluated on, in order, with how they were chosen."""
        return self.state_dir / "eval_queries" / f"{part_name}.json"

    @property
    def bank_dir(self) -> Path:
        """The saved reflection bank: beside the run's other state, not under tables/ (tables/bank is
        the Parquet ``bank`` table, a copy of its rows)."""
        return self.state_dir / BANK_DIR

    @property
    def task_metrics_dir(self) -> Path:
        return self.state_dir / TASK_METRICS_DIR

    def task_metrics_file(self, task: str, step: int) -> Path:
        return self.task_metrics_dir / f"{task}-{step:04d}.json"

    @property
    def rl_progress_file(self) -> Path:
        return self.state_dir / RL_PROGRESS_FILE

    @property
    def config_revisions_file(self) -> Path:
        return self.state_dir / CONFIG_REVISIONS_FILE

    @property
    def tracking_state_file(self) -> Path:
        return self.state_dir / TRACKING_STATE_FILE

    def batch_marker(self, name: str) -> Path:
        """``state/<name>.json``: the id of a submitted provider batch, to re-attach to after a crash."""
        return self.state_dir / f"{name}.json"

    @property
    def rank_logs_dir(self) -> Path:
        """``state/ranks/``: each trainer rank's output (``<kind>-rank<k>.log``), written by the rank itself
        (so a rank's last lines survive its death; on several nodes the run dir is a shared volume)."""
        return self.state_dir / RANK_LOGS_DIR

    @property
    def prefect_server_log(self) -> Path:
        return self.state_dir / PREFECT_SERVER_LOG

    # ---- mlflow/ -----------------------------------------------------------------------------------
    @property
    def mlflow_dir(self) -> Path:
        return self.root / MLFLOW_DIR

    @property
    def mlflow_db(self) -> Path:
        return self.mlflow_dir / MLFLOW_DB

    @property
    def mlflow_artifacts_dir(self) -> Path:
        return self.mlflow_dir / MLFLOW_ARTIFACTS_DIR

    # ---- policies and checkpoints ------------------------------------------------------------------
    @property
    def policy_dir(self) -> Path:
        return self.root / POLICY_DIR

    @property
    def policy_base_dir(self) -> Path:
        return self.policy_dir / "base"

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def sft_checkpoints_dir(self) -> Path:
        return self.checkpoints_dir / "sft"

    @property
    def sft_final(self) -> Path:
        """The SFT policy: what RL starts from and evaluation falls back to."""
        return final_checkpoint_dir(self.sft_checkpoints_dir)

    @property
    def rl_checkpoints_dir(self) -> Path:
        return self.checkpoints_dir / "rl"

    def rl_step_checkpoint(self, step: int) -> Path:
        return step_checkpoint_dir(self.rl_checkpoints_dir, step)

    def has_sft_policy(self) -> bool:
        """Whether the SFT policy is written: what RL and the benchmarks start from."""
        return holds_policy(self.sft_final)

    # ---- outputs -----------------------------------------------------------------------------------
    @property
    def report_html(self) -> Path:
        return self.root / REPORT_DIR / REPORT_FILE

    @property
    def ablation_dir(self) -> Path:
        return self.root / ABLATION_DIR

    def ablation_run_dir(self, recipe: str) -> Path:
        return self.ablation_dir / recipe

    @property
    def ablation_plot(self) -> Path:
        return self.ablation_dir / ABLATION_PLOT

    @property
    def ablation_curve_plot(self) -> Path:
        return self.ablation_dir / ABLATION_CURVE_PLOT

    def looks_like_run_dir(self) -> bool:
        """Whether the directory holds a run: its tables/ or its config.yaml."""
        return self.tables_dir.is_dir() or self.config_file.is_file()
