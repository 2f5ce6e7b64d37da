"""A word-level tokenizer for the trainer tests that go through TRL's text path.

`WORDS` is its vocabulary ("w0" … "w119", after "<pad>" = 0 and "<eos>" = 1);
`make_tokenizer(path)` saves it as a `PreTrainedTokenizerFast` (whitespace split, unknown
words map to "<pad>") so a trainer loads it with `AutoTokenizer.from_pretrained`, the way a
user's tokenizer is loaded. Text built from `WORDS` tokenizes to exactly one id per word.
"""

from __future__ import annotations

WORDS = [f"w{i}" for i in range(120)]


def make_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(path)
