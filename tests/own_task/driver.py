"""A user's own driver loop on the Python API (tests/dist/test_api.py): its own sampling order, its own
reward, two optimizer steps; writes the groups it trained on (a rollouts file), a checkpoint, and the
weights `hf_weights` hands out.   python driver.py OUT [key=value overrides]"""

import random
import sys
from pathlib import Path

from safetensors.torch import save_file

from longstraw_mcore.api import Session
from longstraw_mcore.data.rollouts import RolloutGroup, write_rollouts


def main():
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    s = Session.create("configs/qwen3.6-tiny.yaml", overrides=overrides)
    rng = random.Random(7)
    trained, metrics = [], []
    for step in range(2):
        groups = []
        for i in range(s.cfg.train.groups_per_step):
            prompt = [rng.randrange(3, s.cfg.model.vocab_size) for _ in range(rng.randint(10, 20))]
            g = s.sample(prompt, index=100 * step + i)
            rewards = [len(set(r)) / len(r) + 0.01 * r[0] for r in g.responses]   # the driver's own reward
            groups.append(RolloutGroup(prompt=prompt, responses=g.responses, rewards=rewards, old_logprobs=g.logprobs))
        metrics.append(s.step(groups))
        trained += groups
    ckpt = s.save(out / "api_ckpt")
    weights = {name: t.clone() for name, t in s.hf_weights()}
    write_rollouts(out / "groups.jsonl", trained)
    save_file(weights, str(out / "weights.safetensors"))
    print("losses", [m["loss"] for m in metrics], "checkpoint", ckpt)


if __name__ == "__main__":   # (checkpoint writers start processes that import this file)
    main()
