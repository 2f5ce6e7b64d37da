"""Multimodal data: processor outputs -> packed rows -> SP shards with their vision work.

`spec.py` (what the data stage knows of a vision-language model), `items.py` (images and
videos paired with their placeholder tokens), `positions.py` (M-RoPE per document),
`routing.py` (who encodes what, where the embeddings go), `sharding.py`
(`shard_multimodal`), `collator.py` (documents with images packed and planned by cost).
Pure data: no process group is touched here.
"""
