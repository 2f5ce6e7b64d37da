"""RLOO (TRL RLOOTrainer) exact under sequence parallelism; shares GRPO's rollout pieces (training/grpo/)."""
