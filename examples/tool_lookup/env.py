"""Tool-lookup environment for the dataset path (`longstraw train --env MOD:ToolLookupEnv`, MOD this
file's module): the built-in task's episode (tasks/tool_lookup.py) in text.

    turn 1   the policy's call (any text: the tool answers every call)
    tool     the row's secret word, e.g. "v3"          observation, done=False, reward 0
    turn 2   the policy's answer                       "", done=True, reward 1.0 if it is the secret

The secret is only in the tool's output (rows from examples/tool_lookup/make_dataset.py), so a policy
that ignores it scores 1 / task.n_values. With one token per turn (rollout.max_tokens=1, as the built-in
task) and the word tokenizer, the reward equals tool_lookup.reward on the same token ids.
"""


class ToolLookupEnv:
    def reset(self, row: dict) -> None:
        self.secret, self.turn = row["secret"], 0

    def step(self, text: str) -> tuple[str, bool, float]:
        self.turn += 1
        if self.turn == 1:
            return self.secret, False, 0.0
        assert self.turn == 2, f"step after the episode ended (turn {self.turn})"
        return "", True, float(text.strip() == self.secret)
