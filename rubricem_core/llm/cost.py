"""Dollar cost of one call, from litellm's bundled price map or the endpoint's own prices.

The price map is the copy shipped inside litellm (the project sets LITELLM_LOCAL_MODEL_COST_MAP so
litellm never fetches it); nothing here touches the network.
"""

from __future__ import annotations

from typing import Any

from rubricem_core.llm._litellm import litellm
from rubricem_core.llm.types import EndpointSettings


def _price_entry(model: str) -> dict[str, Any] | None:
    """The cost-map entry for a litellm model string, with or without its provider prefix."""
    candidates = [model]
    if "/" in model:
        candidates.append(model.split("/", 1)[1])
    for name in candidates:
        entry = litellm.model_cost.get(name)
        if isinstance(entry, dict) and entry.get("input_cost_per_token") is not None:
            return entry
    return None


def call_cost(
    model: str,
    prompt_tokens: int,
    completion_tokens: int,
    settings: EndpointSettings,
    batch: bool = False,
) -> float:
    """Cost in USD; 0.0 when neither the price map nor the settings know the model.

    Batch calls use the map's batch prices when it lists them, else the full price times
    ``settings.batch_discount``.
    """
    if prompt_tokens < 0 or completion_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got {prompt_tokens}, {completion_tokens}")
    entry = _price_entry(model)
    if entry is not None:
        input_price = float(entry.get("input_cost_per_token") or 0.0)
        output_price = float(entry.get("output_cost_per_token") or 0.0)
        if batch:
            batch_input = entry.get("input_cost_per_token_batches")
            batch_output = entry.get("output_cost_per_token_batches")
            if batch_input is not None and batch_output is not None:
                return prompt_tokens * float(batch_input) + completion_tokens * float(batch_output)
            return (prompt_tokens * input_price + completion_tokens * output_price) * settings.batch_discount
        return prompt_tokens * input_price + completion_tokens * output_price
    if settings.input_cost_per_token is not None or settings.output_cost_per_token is not None:
        cost = prompt_tokens * (settings.input_cost_per_token or 0.0) + completion_tokens * (
            settings.output_cost_per_token or 0.0
        )
        return cost * settings.batch_discount if batch else cost
    return 0.0
