"""Override sets of the tiny profile that the end-to-end flow tests share (no heavy imports: the flow test
modules import it when collected)."""

from __future__ import annotations

# What the end-to-end flow tests (ablation, evaluate) share: 120 documents, the compact prompt, a 1-layer
# width-32 Qwen3, short rollouts with 2 tool calls, 2 queries per benchmark.
FLOW_TINY = {
    "data.world.n_documents": 120,
    "policy.prompt_style": "compact",
    "policy.vocab_size": 700,
    "policy.hidden_size": 32,
    "policy.n_layers": 1,
    "policy.n_heads": 2,
    "policy.n_kv_heads": 1,
    "policy.intermediate_size": 64,
    "rollout.max_new_tokens": 24,
    "rollout.max_total_tokens": 900,
    "tools.max_tool_calls": 2,
    "eval.max_queries": 2,
}
