"""tasks/tokenizer_build.py through transformers.AutoTokenizer: the word tokenizer's ids are the word
list's positions and decode joins words with single spaces; the BPE tokenizer round-trips any text,
keeps each digit one token, has its eos and chat template. Not covered: merges' quality (vocabulary
use), tokenizers too large for a unit test."""

import pytest

from longstraw_mcore.tasks.tokenizer_build import train_bpe, word_tokenizer

transformers = pytest.importorskip("transformers")


def test_word_tokenizer_ids_are_positions(tmp_path):
    words = ["<unused>", "M"] + [f"v{i}" for i in range(4)] + [f"d{i}" for i in range(12)]
    tok = transformers.AutoTokenizer.from_pretrained(word_tokenizer(words, tmp_path / "w"))
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert len(tok) == len(words) and tok.eos_token is None
    ids = [3, 0, 17, 1, 1, 5, 9]
    text = " ".join(words[i] for i in ids)
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.decode(ids) == text
    assert tok.encode("  d3\n v0\tM ", add_special_tokens=False) == [9, 2, 1]   # any whitespace separates
    with pytest.raises(Exception):
        tok.encode("v0 nope", add_special_tokens=False)


def test_word_tokenizer_eos_and_checks(tmp_path):
    words = ["a", "b", "<eos>"]
    tok = transformers.AutoTokenizer.from_pretrained(word_tokenizer(words, tmp_path / "w", eos="<eos>"))
    assert tok.eos_token == "<eos>" and tok.eos_token_id == 2
    assert tok.encode("b a <eos>", add_special_tokens=False) == [1, 0, 2]
    assert tok.decode([1, 0, 2], skip_special_tokens=True) == "b a"
    with pytest.raises(ValueError, match="duplicates"):
        word_tokenizer(["a", "a"], tmp_path / "x")
    with pytest.raises(ValueError, match="not one of"):
        word_tokenizer(["a", "b"], tmp_path / "x", eos="c")
    with pytest.raises(ValueError, match="whitespace"):
        word_tokenizer(["a b"], tmp_path / "x")


def test_bpe_round_trip_digits_eos_template(tmp_path):
    names = ["apple", "river", "stone", "cloud", "tiger", "lemon", "quiet", "purple", "window", "garden"]
    corpus = [f"def {names[i % 10]}_{names[i // 10 % 10]}(x):\n    return {names[i * 7 % 10]}(x) + {i * 37}\n"
              for i in range(200)]
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = transformers.AutoTokenizer.from_pretrained(train_bpe(corpus, tmp_path / "b", 300, chat_template=template))
    assert len(tok) == 300
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    for text in corpus[:5] + ["  x\n\n\tÿ 日本 ✓ 1234567890", "return 5\nAnswer: 7"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    digit = {d: tok.encode(d, add_special_tokens=False) for d in "0123456789"}
    assert all(len(v) == 1 for v in digit.values())
    for text in ["x12 = 345", "return 5", "f(0)9"]:   # each digit is its own token, whatever surrounds it
        ids = tok.encode(text, add_special_tokens=False)
        assert [i for i in ids if [i] in digit.values()] == [digit[c][0] for c in text if c.isdigit()]
    eos = tok.encode("a<|endoftext|>", add_special_tokens=False)
    assert eos[-1] == 0 and tok.decode(eos, skip_special_tokens=True) == "a"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<user>hi\n<assistant>"
