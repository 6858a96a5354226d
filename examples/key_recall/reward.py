"""Key-recall reward for the dataset path (`--reward examples/key_recall/reward.py:reward`): the fraction
of the key's words a response repeats, position by position (a missing position scores 0, words past
the key's length are ignored): tasks/key_recall.reward on the words instead of the token ids, the same
number (one word per token id: examples/key_recall/make_dataset.py)."""


def reward(responses: list[str], row: dict) -> list[float]:
    key = row["key"].split()
    if not key:
        raise ValueError(f"row has an empty key: {row!r}")
    return [sum(a == b for a, b in zip(r.split(), key)) / len(key) for r in responses]
