"""Supervised fine-tuning and pre-training: `LongContextTrainerMixin` / `LongContextTrainer`
(token-level loss over packed documents), in front of `transformers.Trainer` or TRL's `SFTTrainer`."""
