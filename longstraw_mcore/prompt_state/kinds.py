"""One record per layer type of a model family: what the state containers and the planner know of it.

A family (families/<name>.py) maps each of its layer types (`ModelConfig.layer_types` names them) to a
`LayerKind`; the record is handed to whoever needs it (the model, which hands it to the containers
when the replay allocates a state; the planner), so nothing below the family registry switches on a
layer type or a family name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


def _none(m, T: int, keys: int, tp: int = 1, attention: str = "plain") -> int:
    return 0


def _no_checkpoints(m, T: int, query_block: int = 0, kernel: str = "plain") -> int:
    return 0


@dataclass(frozen=True)
class LayerKind:
    state: type
    """Its prompt-state kind (a `prompt_state.base.LayerState` subclass): allocation, phase hooks, bytes."""
    activation_bytes: Callable
    """(m, tp, T, layer, keys, produce_only) -> bytes autograd keeps for T tokens through the whole layer
    (mixer, MLP, norms; `keys`: the prompt rows it sees; `produce_only`: only as far as its state, exact
    mode's recompute of the model's last layer). planner/activations.py."""
    norm_bytes: Callable
    """(hidden, e) -> bytes one of the family's norms keeps per token (the final norm is the layers' kind)."""
    flops: object
    """Its FLOP counts per phase (planner/flops.py's `LayerFlops` interface)."""
    scratch_bytes: Callable = _none
    """(m, T, keys, tp, kernel) -> the layer's capture peak for T tokens (no autograd) where its scores are the
    widest moment: the DSA indexer's with what is alive beside it. Without `capture_bytes` the planner
    takes the larger of this and `activation_bytes` (its other intermediates, an upper bound). Its scores
    are also made under autograd (the replay, exact mode's sweep), beside the earlier layers' saved
    tensors: the planner counts that moment too (planner/memory.py phase_bytes)."""
    capture_bytes: Callable | None = None
    """(m, T, keys, tp, attention) -> the layer's capture peak for T tokens (no autograd), counted at its
    worst moment (mixer or MLP) for the attention kernel that runs ("plain" / "flash",
    ops/kernel_choice.py); where set, the planner takes it alone (planner/activations.py)."""
    backward_scratch: Callable = _none
    """(m, T, keys, tp, attention) -> what the layer's backward makes beside its saved tensors (plain
    attention: its score blocks, recomputed from the log-sum-exp; flash: the op's row terms and
    gradients): with memory.recompute=layer, a layer's backward holds its recomputed saved tensors and
    this."""
    kernel_name: Callable | None = None
    """(ops, device, dtype) -> the kernel its mixer runs where that is not ops.attention's (GLM's MLA + DSA:
    ops.dsa's, ops/kernel_choice.py dsa_kernel_name), handed to the callables above as their `attention`
    / `kernel` and to `activation_bytes` as `kernel`; None: the attention kernel."""
    checkpoints: Callable = _no_checkpoints
    """(m, T, query_block, kernel) -> torch.utils.checkpoint calls the layer's forward makes under autograd
    (GLM's memory.mla_query_block blocks): each keeps the CPU RNG state (planner/activations.py
    RNG_STATE_BYTES)."""

    def capture_moment(self, m, T: int, keys: int, tp: int, attention: str) -> int:
        """The capture's counted moment (`capture_bytes`), or where a kind has none its scores' moment."""
        if self.capture_bytes is not None:
            return self.capture_bytes(m, T, keys, tp, attention)
        return self.scratch_bytes(m, T, keys, tp, attention)
