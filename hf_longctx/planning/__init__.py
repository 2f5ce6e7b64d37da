"""Planning tools behind `hf-longctx plan`: the per-GPU memory model (`memory`), the
search over parallel settings (`search`) and the per-rank load figure (`plot`)."""
