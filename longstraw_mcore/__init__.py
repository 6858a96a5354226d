"""longstraw-mcore: Megatron-Core branch replay for million-token GRPO post-training."""

__version__ = "0.1.0"
