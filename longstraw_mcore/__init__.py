"""longstraw-mcore: Megatron-Core branch replay for million-token GRPO post-training.

Shape legend, one for the package (docstrings and `x_TBH`-style comments use it):

    B    batch: the branches (responses) replayed together, or 1 for the prompt
    T    tokens of one call: its queries (a capture chunk, a branch); Megatron's hidden states are [T, B, Hd]
    S    keys one call attends to (a key set, the latents it sees)
    P    prompt tokens (P - 1 are captured: the last one starts every branch); P_c captured positions
    R    response (branch) tokens;  G  branches per prompt group
    H    heads: Hq query, Hk key/value, Hv / hk Gated DeltaNet value / key heads, Hi indexer heads
         (lower case h: the heads local to a tensor-parallel rank)
    D    head dim: Dk, Dv (GDN), Dn / Dr / Dv (MLA no-RoPE / RoPE / value), Di (indexer);  Hd hidden size
    R    in MLA contexts: kv_lora_rank, the latent's width (the response length is then written R_b)
    C    the Gated DeltaNet chunk;  W  the conv width;  Ch  conv channels;  k  DSA's top-k
"""

__version__ = "0.1.0"

from longstraw_mcore import lazy_compile as _lazy_compile  # noqa: E402

_lazy_compile.install()  # Megatron's torch.compile fusions compile at first call, not at import
