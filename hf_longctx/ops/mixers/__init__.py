"""Sequence parallelism through the linear token mixers of hybrid models (pure tensor ops).

layout.py    where every token of a packed batch lives across the SP group; halo plans
exchange.py  differentiable uneven all-to-all: channel scatter/gather, halo rows
conv.py      per-document causal depthwise convolution (whole sequence, or halo on a shard)
gdn.py       Gated DeltaNet: head-parallel all-to-all by key-head group
mamba2.py    Mamba-2 / SSD: head-parallel all-to-all with group replication
state_passing.py  the segmented scan of per-run state maps over the SP group (+ its adjoint)
gdn_state.py      Gated DeltaNet by state passing (one augmented kernel call, exact correction)
mamba2_state.py   Mamba-2 by state passing (decay + final state, exact correction)
cost.py      both schemes' bytes / collectives / extra FLOPs and the rule that picks one
rglru.py     RG-LRU: state passing of per-run affine summaries (all-gather: tiny maps)
Never imports transformers; `integrations/mixers/` binds these to the HF modules.
"""
