"""prefect.yaml's pull step: a worker's flow run runs from a checkout of this repository.

The checkout is ``RUBRICEM_HOME`` when the worker's environment sets it (deployments/start_worker.sh
exports it), else the checkout this package is installed from (`make install`: an editable install),
so the plain `prefect worker start --pool rubricem-process` that `prefect deploy` suggests works too.
"""

from __future__ import annotations

import os
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


def set_checkout_directory(directory: str = "") -> dict[str, str]:
    """Change into the checkout (``directory``, templated from ``$RUBRICEM_HOME``; empty: this
    package's checkout) and return it, as Prefect's set_working_directory step does."""
    target = Path(directory) if directory else CHECKOUT
    if not (target / "prefect.yaml").is_file():
        raise FileNotFoundError(
            f"{target} is not a RubricEM checkout (no prefect.yaml): set RUBRICEM_HOME in the worker's "
            "environment to the checkout to run flows from (deployments/start_worker.sh does)"
        )
    os.chdir(target)
    return {"directory": str(target)}
