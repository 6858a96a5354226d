"""Memory and FLOP models of a group step (the `longstraw plan` planner builds on these)."""
