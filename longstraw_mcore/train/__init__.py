"""The training loop: DDP, optimizer, checkpoints."""
