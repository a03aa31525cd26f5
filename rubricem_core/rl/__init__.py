"""The windowed RL loop's pure parts: curriculum, per-step advantages and the SS-GRPO update."""
