"""Branch replay: capture once, replay each branch, exact-mode prompt backward."""
