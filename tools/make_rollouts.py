#!/usr/bin/env python
"""Write a synthetic rollouts file (JSON Lines prompt groups) for demos, tests and benchmarks.

  python tools/make_rollouts.py OUT --vocab 512 --groups 8 --prompt-len 96 --group-size 4 --response-len 16
  python tools/make_rollouts.py OUT --vocab 512 --prompt-len 96 --tree

Token ids are uniform in [0, vocab); response lengths vary in [1, response_len]; rewards are uniform
in [0, 1) (so no group has all-equal rewards unless --equal-reward-every K marks every K-th group).
--tree: one group whose four responses share prefixes (`tree_group`: the prefix-tree segments a kernel
check exercises); --groups, --group-size and --response-len do not apply.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_groups(vocab, groups, prompt_len, group_size, response_len, seed=0, equal_reward_every=0):
    import random

    from longstraw_mcore.data.rollouts import RolloutGroup

    rng = random.Random(seed)
    out = []
    for gi in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        responses = [[rng.randrange(vocab) for _ in range(rng.randint(1, response_len))] for _ in range(group_size)]
        rewards = [round(rng.random(), 4) for _ in range(group_size)]
        if equal_reward_every and gi % equal_reward_every == equal_reward_every - 1:
            rewards = [0.5] * group_size
        out.append(RolloutGroup(prompt=prompt, responses=responses, rewards=rewards))
    return out


def tree_group(vocab: int, prompt_len: int):
    """One group of a `prompt_len`-token prompt and responses [a + 5, a + 3, b + 6, 7 tokens] with shared
    prefixes a (4 tokens) and b (3): the first two replay their shared tokens once, as a segment."""
    import random

    from longstraw_mcore.data.rollouts import RolloutGroup

    rng = random.Random(3)
    tok = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    shared_a, shared_b = tok(4), tok(3)
    responses = [shared_a + tok(5), shared_a + tok(3), shared_b + tok(6), tok(7)]
    return RolloutGroup(prompt=tok(prompt_len), responses=responses, rewards=[0.1, 0.9, 0.4, 0.7])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--response-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--equal-reward-every", type=int, default=0)
    p.add_argument("--tree", action="store_true", help="one group whose responses share prefixes (tree_group)")
    a = p.parse_args(argv)
    from longstraw_mcore.data.rollouts import write_rollouts

    if a.tree:
        write_rollouts(a.out, [tree_group(a.vocab, a.prompt_len)])
        print(f"wrote one prefix-tree group to {a.out}")
        return 0
    write_rollouts(a.out, make_groups(a.vocab, a.groups, a.prompt_len, a.group_size, a.response_len, a.seed,
                                      a.equal_reward_every))
    print(f"wrote {a.groups} prompt groups to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
