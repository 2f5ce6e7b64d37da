"""A small local corpus, tokenizer and Llama: everything the CPU demo trains, nothing from a hub.

Where it sits: before the data flow, in the recipes. The corpus is the `.py` files of this
Python's own standard library (read with `datasets`), the tokenizer a byte-level BPE trained on
them in seconds with `tokenizers`, the model a small Llama built from a config and saved with
`save_pretrained`, so that it is loaded back with `from_pretrained` -- the path a real
checkpoint takes.
"""

from __future__ import annotations

import os
import sysconfig

import torch

EOS = "<|endoftext|>"
HEADS = 4  # query heads of the demo Llama (bounds the Ulysses degree of every group)
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3", "turtledemo"}


def stdlib_files(limit: int, min_bytes: int, max_bytes: int) -> list[str]:
    """The first `limit` stdlib `.py` files (sorted walk) of min_bytes..max_bytes: every
    rank lists the same files in the same order."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        for f in sorted(files):
            p = os.path.join(d, f)
            if f.endswith(".py") and min_bytes <= os.path.getsize(p) <= max_bytes:
                out.append(p)
                if len(out) == limit:
                    return out
    return out


def load_corpus(files: list[str]):
    from datasets import Dataset

    texts = []
    for p in files:
        with open(p, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return Dataset.from_dict({"text": texts, "path": files})


def build_tokenizer(texts: list[str], vocab_size: int, path: str):
    """A byte-level BPE trained on the corpus (rank 0), saved, then loaded by every rank."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS)
    tok.save_pretrained(path)


def build_model(vocab_size: int, path: str, args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=16384, tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path)
