"""A rollout group whose responses share segments at several depths (a prefix tree of depth 3), with
loss masks zeroing tokens inside shared and unshared segments; every group of a seed has the same
tree shape (expert-parallel ranks replaying different groups need the same steps).

    a (3 tokens) -> b (2) -> c (2) -> r0: +3 tokens, r1: +1, r7 ends after c
                         -> r2: +2,  r4 ends after b
                -> r3: +4
    r5: 5 tokens, r6: 1 token, sharing nothing
"""

from __future__ import annotations

import torch


def tree_group(m, P: int, seed: int):
    from longstraw_mcore.data.rollouts import RolloutGroup

    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(0, m.vocab_size, (n,), generator=g).tolist()

    # the first tokens after each branching point differ (drawn without replacement), so the shape holds
    first = torch.randperm(m.vocab_size, generator=g).tolist()
    a = [first[0]] + rand(2)
    b, r3_own, r5 = [first[1]] + rand(1), [first[2]] + rand(3), [first[3]] + rand(4)
    c, r2_own = [first[4]] + rand(1), [first[5]] + rand(1)
    r0_own, r1_own = [first[6]] + rand(2), [first[7]]
    r6 = [first[8]]
    responses = [a + b + c + r0_own, a + b + c + r1_own, a + b + r2_own, a + r3_own, a + b, r5, r6, a + b + c]
    masks = [[1] * len(r) for r in responses]
    masks[0][1] = 0      # inside a (shared by r0 r1 r2 r3 r4 r7)
    masks[1][4] = 0      # inside b
    masks[7][5] = 0      # inside c
    masks[3][5] = 0      # inside r3's own tail
    masks[5][2] = 0      # inside an unshared response
    masks[4] = [0, 0, 0, 1, 1]
    lengths = [len(r) for r in responses]
    return RolloutGroup(prompt=rand(P), responses=responses, rewards=torch.rand(len(responses), generator=g,
                                                                                  dtype=torch.float64).tolist(),
                        old_logprobs=[(-3.0 + 0.6 * torch.randn(n, generator=g, dtype=torch.float64)).tolist()
                                      for n in lengths],
                        ref_logprobs=[(-3.0 + 0.6 * torch.randn(n, generator=g, dtype=torch.float64)).tolist()
                                      for n in lengths],
                        loss_masks=masks)


def trie_tokens(responses) -> int:
    """The trie's token count, counted independently of replay/tree.py: distinct non-empty prefixes."""
    return len({tuple(r[:i]) for r in responses for i in range(1, len(r) + 1)})

