"""Attention ops: local kernels with log-sum-exp, the LSE merge, and the sequence-parallel algorithms built on them."""
