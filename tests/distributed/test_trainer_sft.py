"""TRL `SFTTrainer` through `LongContextTrainerMixin`: completion-only loss on 2 ranks
(Ulysses 2, FSDP2) equals the same trainer in one process.

The dataset is prompt–completion text; TRL tokenizes it with the word-level tokenizer of
tests/helpers/word_tokenizer.py and turns its `completion_mask` into `labels` (-100 on the
prompt), which the step collator reads. Checked: the labels really mask the prompt; the logged loss, `grad_norm`,
`mean_token_accuracy` and `entropy` of every step equal the single-process run within 1e-5
(fp32; see test_trainer.py), and the per-step loss is NOT the full-sequence loss (the
completion-only masking changed it). `SFTConfig.max_length` other than None and packing are
refused.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.families import save_family
from tests.helpers.pool import worker_mesh
from tests.helpers.trainer_cases import assert_steps_close, trainer_env
from tests.helpers.word_tokenizer import WORDS, make_tokenizer

TOL = 1e-5


def make_sft_dataset(n: int = 16, seed: int = 0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)

    def text(k: int) -> str:
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (k,), generator=g).tolist())

    rows = [(text(int(a)), " " + text(int(b))) for a, b in torch.randint(3, 18, (n, 2), generator=g)]
    return Dataset.from_dict({"prompt": [p for p, _ in rows], "completion": [c for _, c in rows]})


def _run(model_path: str, tok_path: str, output_dir: str, distributed: bool, peft: str | None = None, **sft: object) -> dict:
    """One short SFT run; `peft`: None, "before" (get_peft_model, then patch) or "config"
    (patch, then SFTTrainer(peft_config=...))."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from hf_longctx import LongContextTrainerMixin, init_sequence_parallel, patch

    class LongSFT(LongContextTrainerMixin, SFTTrainer):
        pass

    trainer_env()
    # bf16=False: SFTConfig defaults to bf16; fp32 makes the 1e-5 comparison meaningful. gradient_checkpointing
    # stays at its SFTConfig default (True): the mixin maps it to patch(checkpoint=True).
    cfg = dict(output_dir=output_dir, max_steps=3, learning_rate=3e-3, logging_steps=1, max_grad_norm=1.0, report_to=[],
               use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0, bf16=False, **{"max_length": None, **sft})
    args = SFTConfig(**cfg)
    mesh = worker_mesh(2, 1) if distributed else init_sequence_parallel()
    model, extra = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), {}
    if peft is not None:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM")
        torch.manual_seed(0)  # LoRA's A is drawn at random: from the same state in both paths
        model, extra = (get_peft_model(model, lora), {}) if peft == "before" else (model, {"peft_config": lora})
    model = patch(model, mesh)
    if peft == "config":
        torch.manual_seed(0)  # TRL wraps the model first thing in SFTTrainer.__init__
    trainer = LongSFT(model=model, args=args, train_dataset=make_sft_dataset(), processing_class=AutoTokenizer.from_pretrained(tok_path),
                      mesh=mesh, max_tokens=64, tokens_per_step=160, **extra)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    first = trainer.train_dataset[0]
    return {"steps": [(h["loss"], h["grad_norm"]) for h in logs],
            "acc": [(h["mean_token_accuracy"], h["entropy"]) for h in logs],
            "masked": first["labels"][0] == -100 and first["labels"][-1] != -100}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    make_tokenizer(str(root / "tok"))
    return save_family("llama", root), str(root / "tok")


def test_sft_completion_only_matches_single_process(pools, paths, tmp_path):
    pytest.importorskip("trl")
    model_path, tok_path = paths
    ref = _run(model_path, tok_path, str(tmp_path / "ref"), False)
    full = _run(model_path, tok_path, str(tmp_path / "full"), False, completion_only_loss=False)
    out = pools.get(2).run(_run, model_path, tok_path, str(tmp_path / "sp"), True, timeout=600)
    assert ref["masked"] and not full["masked"]
    assert abs(full["steps"][0][0] - ref["steps"][0][0]) > 1e-3  # the prompt is really out of the loss
    for rank, res in enumerate(out):
        assert_steps_close(res["steps"], ref["steps"], TOL, f"sft rank {rank}")
        assert_steps_close(res["acc"], ref["acc"], TOL, f"sft metrics rank {rank}")


@pytest.mark.parametrize("kw,match", [(dict(max_length=1024), "max_length=1024"), (dict(packing=True), "packing=True")])
def test_sft_refusals(paths, tmp_path, kw, match):
    pytest.importorskip("trl")
    model_path, tok_path = paths
    with pytest.raises(ValueError, match=match):
        _run(model_path, tok_path, str(tmp_path), False, **kw)


def test_sft_peft_config_equals_wrapping_before_patch(pools, paths, tmp_path):
    """SFTTrainer(peft_config=...) wraps the patched model: on 2 ranks the same steps as a
    LoRA model wrapped before patch() in one process (LoRA's B starts at zero, so the first
    gradients exist only for B: a wrapper that trained the base model would differ)."""
    pytest.importorskip("peft")
    model_path, tok_path = paths
    ref = _run(model_path, tok_path, str(tmp_path / "ref"), False, peft="before")
    full = _run(model_path, tok_path, str(tmp_path / "full"), False)
    out = pools.get(2).run(_run, model_path, tok_path, str(tmp_path / "sp"), True, peft="config", timeout=600)
    assert abs(full["steps"][1][0] - ref["steps"][1][0]) > 1e-4  # LoRA really trains something else
    for rank, res in enumerate(out):
        assert_steps_close(res["steps"], ref["steps"], TOL, f"peft_config rank {rank}")
