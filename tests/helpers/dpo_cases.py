"""The DPO trainer tests' shared set-up: saved models, tokenizer, preference pairs, a gradient grab.

`paths` (a module-scoped pytest fixture; a test module imports it to use it) saves a tiny
Llama policy, a differently seeded reference and the word-level tokenizer, and returns their
three paths. `_text_pairs` makes prompt/chosen/rejected text in TRL's text form,
`_id_pairs` the same pairs as token-id lists (one form `LongDPOTrainer` reads). BETA is the
DPO beta the tests use. `_grab_callback(out)` captures every parameter gradient as the
optimizer sees it (`on_pre_optimizer_step`, full tensors of FSDP2 shards) into `out`.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.word_tokenizer import WORDS, make_tokenizer

BETA = 0.5


def _text_pairs(n: int = 8, seed: int = 0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)

    def text(k: int) -> str:
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (k,), generator=g).tolist())

    rows = []
    for _ in range(n):
        c, r = torch.randint(3, 14, (2,), generator=g).tolist()
        rows.append((text(int(torch.randint(2, 6, (1,), generator=g))), f" {text(c)} <eos>", f" {text(r)} <eos>"))
    return Dataset.from_dict({k: [row[i] for row in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))})


def _id_pairs(tok, text):
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731 (the word-level tokens TRL makes)
    return text.map(lambda x: {k: ids(x[k]) for k in ("prompt", "chosen", "rejected")})


def _grab_callback(out: dict):
    from transformers import TrainerCallback

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            for name, p in model.named_parameters():  # the same order on every rank: full_tensor is a collective
                if p.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    out[name] = g.detach().clone()

    return Grab()


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    import transformers as tf

    root = tmp_path_factory.mktemp("dpo_trainer")
    make_tokenizer(str(root / "tok"))
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    for name, seed in (("policy", 0), ("reference", 1)):
        torch.manual_seed(seed)
        tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(root / name))
    return str(root / "policy"), str(root / "reference"), str(root / "tok")
