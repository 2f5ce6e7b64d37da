"""DPO under sequence parallelism: `LongDPOTrainer` over TRL's `DPOTrainer` (preference pairs as the
planning unit)."""
