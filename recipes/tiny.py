"""A small local corpus, tokenizer and Llama: what the CPU demo and the quickstart train,
nothing from a hub.

Where it sits: before the data flow, in the recipes. The corpus is the `.py` files of this
Python's own standard library (read with `datasets`), the tokenizer a byte-level BPE trained on
them in seconds with `tokenizers`, the model a small Llama built from a config (its special
token ids the tokenizer's) and saved with `save_pretrained`, so that it is loaded back with
`from_pretrained` -- the path a real checkpoint takes.

Run as a script, it writes what the quickstart (docs/getting-started.md) needs:
    python recipes/tiny.py OUT      # OUT/model: Llama + tokenizer; OUT/docs/*.txt: one document per file
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


def build_model(tokenizer, path: str, *, hidden: int = 128, layers: int = 2, seed: int = 0) -> None:
    """A small Llama for `tokenizer` (its vocabulary and its EOS / PAD ids, so the Trainer has
    nothing to realign), saved to `path` with `save_pretrained`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=16384, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)


def main(argv=None) -> None:
    import argparse

    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    p = argparse.ArgumentParser(description="Write OUT/model (a small Llama + byte-level BPE tokenizer, trained "
                                            "locally) and OUT/docs/*.txt (stdlib source files, one document each).")
    p.add_argument("out")
    p.add_argument("--files", type=int, default=64, help="stdlib files copied to OUT/docs, one document each")
    p.add_argument("--max-file-bytes", type=int, default=12000)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    hf_logging.disable_progress_bar()  # save_pretrained's bar for a 0.5M-parameter model says nothing
    files = stdlib_files(args.files, 200, args.max_file_bytes)
    docs, model = os.path.join(args.out, "docs"), os.path.join(args.out, "model")
    os.makedirs(docs, exist_ok=True)
    texts = []
    for i, src in enumerate(files):
        with open(src, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
        with open(os.path.join(docs, f"{i:04d}_{os.path.basename(src)[:-3]}.txt"), "w", encoding="utf-8") as f:
            f.write(texts[-1])
    build_tokenizer(texts, args.vocab, model)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model)
    build_model(tokenizer, model, hidden=args.hidden, layers=args.layers, seed=args.seed)
    tokens = sum(len(ids) + 1 for ids in tokenizer(texts)["input_ids"])  # + EOS, as tokenize_dataset adds it
    print(f"{model}: Llama {args.layers}x{args.hidden} with a {len(tokenizer)}-id byte-level BPE tokenizer; "
          f"{docs}: {len(files)} documents, {tokens} tokens")


if __name__ == "__main__":
    main()
