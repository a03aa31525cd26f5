"""Test doubles and tiny models that tests and benches share (nothing in the method imports them).

Fakes stand in only for third-party services this machine cannot reach, on 127.0.0.1: an
OpenAI-compatible chat/Batch API server (``openai_server``), the web-search APIs (``web_search_server``),
a redirecting web page (``redirect_server``); and two rollout-engine drivers that force a policy's text
(``scaffold_writer``, ``forced_reflections``). ``tiny_models``: random 2-layer Qwen3/Llama models, a BPE
tokenizer over a synthetic world, and token trajectories for update tests. ``MICRO_PROFILE``: the suite's
run as a profile file (``micro.yaml``: the tiny profile shrunk to seconds a stage).
"""

from pathlib import Path

MICRO_PROFILE = str(Path(__file__).with_name("micro.yaml"))
