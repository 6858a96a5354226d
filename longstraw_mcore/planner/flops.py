"""Analytic FLOP counts of a GRPO group step: branch replay (both modes) and naive full-sequence GRPO.

Counts matrix-multiply FLOPs (2*M*N*K), the quantity `torch.utils.flop_counter.FlopCounterMode`
measures. Two counts per phase:
- `algorithm`: what this implementation does: attention over key blocks with query blocking (whole
  blocks where any key is visible), recompute of the scores in the attention backward
  (FlashAttention-2 style, which keeps memory O(queries x block); a branch that stores its
  probabilities over the prompt skips that recompute), log-prob chunks recomputed in
  backward (activation checkpointing), the chunked gated delta rule's matmuls, and the depthwise
  conv as FlopCounterMode counts it (its input gradient is counted like a dense conv).
- `minimum`: the same model math with nothing recomputed and only visible (query, key) pairs:
  forward once, backward = the gradients that are needed (constant prompt keys get none in
  detached mode).
- `model_3x`: the conventional count, forward once and backward = 2 x forward for every matmul.

Padding (replay.batch_tokens): the executor runs the branches of a replay micro-step as one
right-padded batch (replay/steps.py `replay_inputs`), each row as long as the micro-step's longest
branch: a padded row's queries attend to the prompt and to its own row's earlier positions, exactly as
a branch of that length would. So `algorithm` counts each micro-step as its branches x the branch
of its longest length (`padded_steps`, cut by replay/plan.py `micro_steps`, the executor's own
grouping); `minimum` and `model_3x` count every branch at its own length (padding is waste, not work
the step needs).

Every layer's share comes from its family's record (`layers`: {layer type: LayerKind}, whose `flops`
has the `LayerFlops` methods below: planner/flops_hybrid.py for Qwen's, planner/flops_mla.py for
GLM's); this module adds the output layer and sums the phases.
Legend (package): P prompt length (Pc = P - 1 captured), R response length, G group size, C capture
chunk, tp tensor parallel size.
"""

from __future__ import annotations

from typing import Protocol

from longstraw_mcore.replay.plan import micro_steps


class LayerFlops(Protocol):
    """One layer's matmul FLOPs on one TP rank (`kind`: "algorithm" or "minimum"; `layer`: its global index)."""

    def capture(self, m, tp: int, layer: int, chunks: list[tuple[int, int]], kind: str, last: bool = False,
                cp: int = 1) -> float:
        """Every capture chunk [s, e) of the prompt, forward without autograd; `last`: the model's last
        layer (run only as far as its state); `cp`: the context-parallel size (summed over its ranks)."""

    def replay(self, m, tp: int, layer: int, R: int, Pc: int, exact: bool, store_probs: bool, kind: str,
               path: tuple[int, ...] = (), seeded: bool = False) -> float:
        """One branch of R tokens after Pc captured positions, forward and backward (exact: the state's
        gradient too; store_probs: its attention probabilities kept, no score recompute); a prefix tree's
        piece after the segments of lengths `path` (their state read with gradients), `seeded`: a
        segment whose final state receives its children's gradient."""

    def recompute(self, m, tp: int, layer: int, s: int, e: int, last: bool, kind: str, cp: int = 1) -> float:
        """Exact mode: chunk [s, e) recomputed with autograd and back-propagated from its state's
        gradient; `last`: the model's last layer (run only as far as its state)."""

    def forward(self, m, tp: int, layer: int, R: int, Pc: int) -> float:
        """One branch's forward over the visible pairs (the conventional 3x count)."""

    def naive(self, m, tp: int, layer: int, T: int, kind: str) -> float:
        """A full sequence of T tokens, forward and backward (nothing constant: naive GRPO)."""


def clamped_sum(lo: int, hi: int, cap: int) -> int:
    """sum over v in [lo, hi) of min(max(v, 0), cap)."""
    def upto(n):  # sum over v in [0, n) of min(v, cap)
        n = max(n, 0)
        r = min(n, cap + 1)
        return r * (r - 1) // 2 + (n - r) * cap
    return upto(hi) - upto(lo)


def attn_pairs(T: int, q_start: int, S: int, k_start: int, block: int, blocked: bool) -> int:
    """(query, key) pairs computed for T queries at q_start against S keys at k_start (causal): the visible
    pairs, or (`blocked`) every pair of a (query block, key block) with any visible key. Closed forms:
    the planner evaluates this for every chunk of a million-token prompt."""
    if not blocked:  # visible pairs only: query at position q sees keys k_start..min(q, k_start+S-1)
        a = q_start - k_start + 1
        return clamped_sum(a, a + T, S)
    total, key_blocks = 0, -(-S // block)
    for t0 in range(0, T, block):
        tq = min(block, T - t0)
        last_q = q_start + t0 + tq - 1
        if last_q >= k_start:  # key blocks s0 = 0, block, ... with k_start + s0 <= last_q
            total += tq * min(S, block * min(key_blocks, (last_q - k_start) // block + 1))
    return total


def _head(m, tp: int, tokens: int) -> float:
    """The output layer's forward on `tokens`: this rank's 1/tp of the vocabulary's columns (the true
    vocabulary: padded columns, where a config pads, are not counted)."""
    return 2.0 * (m.hidden_size * m.vocab_size // tp) * tokens


def _layers(layers: dict, m):
    return [(i, layers[t].flops) for i, t in enumerate(m.layer_types)]


def pieces(lengths) -> list[tuple[int, tuple[int, ...], bool]]:
    """(tokens, the segment lengths on its path, seeded) of every replayed piece: a flat branch is
    (R, (), False); a prefix tree's segments and tails (replay/tree.py `tree_pieces`) run after the
    prompt and the segments above them, whose keys, latents and GDN state they read as leaves with
    gradients (in both modes); a segment (`seeded`) also back-propagates its final GDN state."""
    return [(x, (), False) if isinstance(x, int) else (int(x[0]), tuple(x[1]), bool(x[2])) for x in lengths]


def padded_steps(lengths, batch_tokens: int) -> list[tuple[int, int, tuple[int, ...], bool]]:
    """(branches, tokens each of them runs, path, seeded) of every replay micro-step of `lengths`
    (`pieces`) under the token budget `batch_tokens` (replay.batch_tokens; 0: one piece per micro-step,
    at its own length), cut as the executor cuts them, by replay/plan.py `micro_steps`: a flat group's
    branches in order; a prefix tree's segments one each, and the tails below each node (the run of
    consecutive tail pieces after the same segments: replay/tree.py `tree_pieces` lists a node's tails
    together, in `tree_steps`' order). Every branch of a micro-step runs its longest one's tokens
    (right-padded: replay/steps.py `replay_inputs`)."""
    out, run = [], []  # run: the tail pieces (tokens, path) of the node being collected

    def cut():
        for a, b in micro_steps([n for n, _ in run], batch_tokens):
            out.append((b - a, max(n for n, _ in run[a:b]), run[a][1], False))
        run.clear()

    for n, path, seeded in pieces(lengths):
        if seeded or (run and run[-1][1] != path):
            cut()
        if seeded:
            out.append((1, n, path, True))
        else:
            run.append((n, path))
    cut()
    return out


def branch_flops(layers: dict, m, P: int, lengths: list, exact: bool, tp: int = 1, store_probs: bool = False,
                 kind: str = "algorithm", batch_tokens: int = 0) -> float:
    """The replay phase: every branch (or prefix-tree piece: `pieces`) forward and backward against
    P - 1 captured positions, the output layer on every branch token: its forward, and in the backward
    dX and dW, plus (algorithm) the log-prob chunk's recompute. `algorithm` runs the micro-steps under
    `batch_tokens` padded (`padded_steps`; 0: one branch each); `minimum` every branch at its length."""
    Pc, per = P - 1, _layers(layers, m)
    head_units = 3 if kind == "algorithm" else 2
    steps = padded_steps(lengths, batch_tokens if kind == "algorithm" else 0)
    # (a segment replays without storing its probabilities: prompt_state/contexts.py SegmentContext)
    return sum(B * (sum(f.replay(m, tp, i, T, Pc, exact, store_probs and not path and not seeded, kind, path, seeded)
                        for i, f in per) + (1 + head_units) * _head(m, tp, T))
               for B, T, path, seeded in steps)


def forward_flops(layers: dict, m, P: int, lengths: list[int], tp: int = 1, batch_tokens: int = 0) -> float:
    """The branches' forward through the decoder layers only (visible pairs, the conventional count's
    forward), in the micro-steps under `batch_tokens` padded (`padded_steps`): what memory.recompute=layer
    runs a second time in the backward."""
    Pc, per = P - 1, _layers(layers, m)
    return float(sum(B * f.forward(m, tp, i, T, Pc + sum(path))
                     for B, T, path, _ in padded_steps(lengths, batch_tokens) for i, f in per))


def step_flops(layers: dict, m, P: int, lengths: list[int], mode: str, chunk_len: int, tp: int = 1,
               store_probs: bool = False, cp: int = 1, batch_tokens: int = 0) -> dict:
    """{"algorithm": {phase: flops}, "minimum": {phase: flops}, "model_3x": {...}} for one group step of
    branch replay (`layers`: the family's {layer type: LayerKind}; `lengths`: the branches' lengths, or
    a prefix tree's (tokens, depth) pieces).

    `store_probs`: every micro-step keeps its attention probabilities over the prompt (no score
    recompute in its backward; `replay.attn_probs_budget_mib`, which the executor checks per micro-step:
    replay/steps.py `stores_attention_probs`). `batch_tokens`: replay.batch_tokens, the token budget the
    replay's micro-steps are cut by (`padded_steps`; 0: one branch per micro-step); the algorithm count
    includes their padding. `cp`: the context-parallel size, for what a layer does differently under it
    (Gated DeltaNet by sequence pieces: planner/flops_hybrid.py); the capture and the sweep are then the
    sum over the cp ranks."""
    Pc = P - 1
    chunks = [(s, min(Pc, s + chunk_len)) for s in range(0, Pc, chunk_len)]
    per = _layers(layers, m)
    exact = mode == "exact"
    out = {}
    for kind in ("algorithm", "minimum"):
        last = len(per) - 1
        ph = {"capture": sum(f.capture(m, tp, i, chunks, kind, i == last, cp=cp) for i, f in per)}
        ph["replay"] = branch_flops(layers, m, P, lengths, exact, tp, store_probs, kind, batch_tokens)
        if exact:
            ph["prompt_backward"] = sum(f.recompute(m, tp, i, s, e, i == last, kind, cp=cp) for s, e in chunks
                                        for i, f in per)
        out[kind] = ph
    # The conventional model count: forward once, backward = 2 x forward for every matmul (attention
    # included, whether or not its keys need a gradient).
    conv = {"capture": out["minimum"]["capture"]}
    conv["replay"] = 3 * sum(sum(f.forward(m, tp, i, R, Pc + sum(path)) for i, f in per) + _head(m, tp, R)
                             for R, path, _ in pieces(lengths))
    if exact:
        conv["prompt_backward"] = 3 * out["minimum"]["capture"]
    out["model_3x"] = conv
    for kind in out:
        out[kind]["total"] = sum(out[kind].values())
    return out


def naive_flops(layers: dict, m, P: int, lengths: list[int], tp: int = 1) -> dict:
    """Plain full-sequence GRPO: every branch runs [prompt, y_b] forward and backward."""
    per = _layers(layers, m)
    out = {"algorithm": 0.0, "minimum": 0.0}
    for R in lengths:
        T = P + R - 1
        for kind in out:
            head_units = 3 if kind == "algorithm" else 2
            out[kind] += sum(f.naive(m, tp, i, T, kind) for i, f in per) + (1 + head_units) * _head(m, tp, R)
    return out
