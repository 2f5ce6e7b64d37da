"""Sequence parallelism through the linear token mixers of hybrid models (pure tensor ops).

layout.py    where every token of a packed batch lives across the SP group; halo plans
exchange.py  differentiable uneven all-to-all: channel scatter/gather, halo rows
conv.py      per-document causal depthwise convolution (whole sequence, or halo on a shard)
gdn.py       Gated DeltaNet: head-parallel all-to-all by key-head group
mamba2.py    Mamba-2 / SSD: head-parallel all-to-all with group replication
rglru.py     RG-LRU: state passing of per-run affine summaries
Never imports transformers; `integrations/mixers/` binds these to the HF modules.
"""
