"""Vision-language training through the Trainer path on 4 gloo ranks (U2×R2, FSDP2) vs one process.

Two paths of recipes/vlm_sft.py's tiny Qwen2.5-VL, its processor and synthetic data:
- `LongContextTrainer` on rows of processor outputs (images of several sizes and a video),
  full fine-tuning: the tower and projector live in FSDP2's root unit and train; ranks that
  encode nothing in a micro-batch still reduce-scatter (unused parameters);
- TRL's `SFTTrainer` (through `LongContextTrainerMixin`) on conversations with images and
  the processor as `processing_class` -- TRL's own vision collator processes each example --
  with LoRA on the language model (tower and projector frozen: the embedding exchange then
  carries no gradient on any rank).
Every logged step's loss and grad_norm (and TRL's token metrics) equal the single-process run
of the same trainer within 1e-5 (fp32); the updates moved the loss.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers.pool import worker_mesh
from tests.helpers.trainer_cases import assert_steps_close, trainer_env

TOL = 1e-5
RECIPES = os.path.join(os.path.dirname(__file__), "..", "..", "recipes")


def _run(output_dir: str, distributed: bool, trl: bool) -> dict:
    sys.path.insert(0, RECIPES)
    import vlm_sft
    from transformers import TrainingArguments

    from hf_longctx import LongContextTrainer, LongContextTrainerMixin, init_sequence_parallel, patch

    trainer_env()
    common = dict(output_dir=output_dir, max_steps=3, learning_rate=3e-3, logging_steps=1, max_grad_norm=1.0,
                  report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0)
    mesh = worker_mesh(2, 2) if distributed else init_sequence_parallel()
    processor = vlm_sft.build_processor()
    model = vlm_sft.build_model(processor, seed=0)
    if trl:
        from peft import LoraConfig, get_peft_model
        from trl import SFTConfig, SFTTrainer

        class LongSFT(LongContextTrainerMixin, SFTTrainer):
            pass

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                                 target_modules=r".*language_model.*\.(q|k|v|o)_proj"))
        args = SFTConfig(**common, bf16=False, max_length=None, packing=False, gradient_checkpointing=False)
        trainer = LongSFT(model=patch(model, mesh), args=args, train_dataset=vlm_sft.conversations(12, 0),
                          processing_class=processor, mesh=mesh, max_tokens=128, tokens_per_step=256)
    else:
        trainer = LongContextTrainer(model=patch(model, mesh), args=TrainingArguments(**common),
                                     train_dataset=vlm_sft.processor_rows(processor, 12, 0), processing_class=processor,
                                     mesh=mesh, max_tokens=128, tokens_per_step=256)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    out = {"steps": [(h["loss"], h["grad_norm"]) for h in logs]}
    if trl:
        out["acc"] = [(h["mean_token_accuracy"], h["entropy"]) for h in logs]
        out["trainable"] = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    out["columns"] = trainer.train_dataset.column_names
    return out


@pytest.mark.parametrize("trl", [False, True], ids=["trainer_full", "trl_sft_lora"])
def test_vlm_trainer_matches_single_process(pools, tmp_path, trl):
    if trl:
        pytest.importorskip("trl")
    ref = _run(str(tmp_path / "ref"), False, trl)
    out = pools.get(4).run(_run, str(tmp_path / "sp"), True, trl, timeout=600)
    assert len(ref["steps"]) == 3 and ref["steps"][-1][0] < ref["steps"][0][0], ref  # it trains
    assert {"pixel_values", "image_grid_thw"} <= set(ref["columns"])
    if trl:
        assert ref["trainable"] and all("lora_" in n for n in ref["trainable"]), ref["trainable"]
    else:
        assert {"pixel_values_videos", "video_grid_thw"} <= set(ref["columns"])
    for rank, res in enumerate(out):
        assert_steps_close(res["steps"], ref["steps"], TOL, f"vlm trainer rank {rank}")
        if trl:
            assert_steps_close(res["acc"], ref["acc"], TOL, f"vlm sft metrics rank {rank}")
