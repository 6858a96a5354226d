"""A deterministic multi-turn environment for the layout tests (tests/dist/test_env_layouts.py): three
policy turns, two observations between them, each observation two words (a word of the row's and the
turn's first word echoed), the reward a deterministic function of what the policy wrote."""


class Echo:
    def reset(self, row):
        self.row, self.turn, self.seen = row, 0, []

    def step(self, text):
        words = text.split()
        self.seen += words
        self.turn += 1
        if self.turn == 3:
            return "", True, len(set(self.seen)) / 6.0
        return f"{self.row['tag']} {words[0] if words else self.row['tag']}", False, 0.1 * len(words)
