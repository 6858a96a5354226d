"""Prompt state: containers per layer type and the contexts that capture, replay and recompute it."""
