"""What fits and how fast per parallel setting, behind `hf-longctx plan`: the per-token memory
budget (`budget`, over `budget_terms` and `layer_split_budget`), the per-GPU memory estimate
(`estimate`), the cluster (`cluster`), the step-time model (`step_time`), MFU's numerator (`mfu`), the search over
settings (`search`), the linear recurrences' two sequence-parallel schemes (`mixers`) and what
a vision tower adds (`vision`)."""
