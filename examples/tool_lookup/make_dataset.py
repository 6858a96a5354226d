"""Write the built-in tool-lookup task (tasks/tool_lookup.py) as a text dataset for the dataset path
with an environment (examples/tool_lookup/env.py):

    PYTHONPATH=. python examples/tool_lookup/make_dataset.py --config configs/demo-tool-lookup.yaml \
        --dp 2 --steps 60 --out runs/tool_lookup_data [key=value overrides]

DIR/train.jsonl: row k is the prompt `train --online` draws as prompt k on `--dp` data-parallel ranks
over `--steps` steps (longstraw_mcore/tasks/builtin_text.py derives the order); DIR/heldout.jsonl: the
held-out prompts (task.eval_prompts unless --heldout); DIR/tokenizer: one word per token id, as
examples/key_recall/make_dataset.py. Rows: {"prompt": "d4 d17 ... M", "secret": "v3"}: the secret is
metadata for the environment (the tool's answer), never in the prompt.
"""

from longstraw_mcore.tasks.builtin_text import as_text, write_cli


def row(words: list[str], prompt: list[int], secret: int) -> dict:
    return {"prompt": as_text(words, prompt), "secret": words[secret]}


def main(argv=None):
    write_cli(__doc__, "tool_lookup", row, argv)


if __name__ == "__main__":
    main()
