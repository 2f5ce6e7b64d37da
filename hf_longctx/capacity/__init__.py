"""Planning tools behind `hf-longctx plan`: the per-GPU memory estimate (`estimate`), the
search over parallel settings (`search`), the linear recurrences' two sequence-parallel
schemes (`mixers`) and the per-rank load figure (`plot`)."""
