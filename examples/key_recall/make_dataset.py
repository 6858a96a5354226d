"""Write the built-in key-recall task (tasks/key_recall.py) as a text dataset for the dataset path:

    PYTHONPATH=. python examples/key_recall/make_dataset.py --config configs/demo-key-recall.yaml \
        --dp 2 --steps 60 --out runs/key_recall_data [key=value overrides, as `longstraw train` takes]

DIR/train.jsonl: row k is the prompt `train --online` draws as prompt k on `--dp` data-parallel ranks
over `--steps` steps (the config's groups_per_step, curriculum and task.seed;
longstraw_mcore/tasks/builtin_text.py derives the order), so with dataset.shuffle=false the dataset path
trains on the same token ids in the same order. DIR/heldout.jsonl: the held-out prompts (task.eval_prompts
of them unless --heldout). DIR/tokenizer: one word per token id ("M" the marker, "v3" a value, "d17" a
distractor, id 0 unused) and no end-of-sequence token: responses stop at rollout.max_tokens (the demo
config: 1, task.key_len).

Rows: {"prompt": "d4 d17 v3 d0 ... M", "key": "v3"} (the key's value words, space-separated);
reward.py scores a response against "key".
"""

from longstraw_mcore.tasks.builtin_text import as_text, write_cli


def row(words: list[str], prompt: list[int], key: list[int]) -> dict:
    return {"prompt": as_text(words, prompt), "key": as_text(words, key)}


def main(argv=None):
    write_cli(__doc__, "key_recall", row, argv)


if __name__ == "__main__":
    main()
