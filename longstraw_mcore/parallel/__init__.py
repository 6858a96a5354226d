"""Process groups and collectives. Knows no model and no schedule."""
