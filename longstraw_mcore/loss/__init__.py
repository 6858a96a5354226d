"""Objectives (GRPO, DPO) and vocab-parallel log-probs. They see log-probs, not layers."""
