"""Sequence parallelism through the linear token mixers of hybrid models (pure tensor ops).

layout.py, exchange.py: where every token lives across the SP group; uneven all-to-alls.
conv.py: per-document causal depthwise convolution (whole sequence, or halo on a shard).
gdn.py, mamba2.py: head-parallel all-to-all (Gated DeltaNet, Mamba-2 / SSD).
state_passing.py, gdn_state.py, mamba2_state.py: the segmented scan of per-run state
maps, and each core corrected exactly for its incoming state; rglru.py: RG-LRU (all-gather).
cost.py: both schemes' bytes / collectives / FLOPs and the rule that picks one.
Never imports transformers; `integrations/mixers/` binds these to the HF modules."""
