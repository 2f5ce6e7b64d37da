"""Data stage of hf_longctx: from a `datasets` corpus to per-rank micro-batches.

Data flow (DESIGN.md, "One training step"): `pipeline.py` tokenizes documents and
records their lengths; `sampler.py` draws the same global list of documents for each
step on every rank; `cost.py` estimates each document's time T(l) = a·l² + b·l + c
(Hydraulis, FlexSP appendix); `packing.py` assigns documents to DP ranks and
micro-batches under a token cap, balancing the step time when ranks synchronise at
every micro-batch; `sharding.py` then lays one micro-batch out over the SP group with
the token permutation of `hf_longctx/layout.py` (the floor below). Everything here is
pure Python/NumPy/torch tensors and never touches torch.distributed: every rank
computes the same result from the same inputs.
"""
