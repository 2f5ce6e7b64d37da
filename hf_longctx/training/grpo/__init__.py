"""GRPO under sequence parallelism: `LongGRPOTrainer` over TRL's `GRPOTrainer`, and `grpo_step` for a
loop of your own."""
