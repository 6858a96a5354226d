"""Rollout data: the JSON Lines prompt-group format and its validation."""
