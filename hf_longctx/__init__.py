"""hf_longctx: sequence-parallel long-context training for Hugging Face causal LMs.

Public API only; see README.md and DESIGN.md for the data flow.
"""

from hf_longctx.distributed.mesh import SPMesh, init_sequence_parallel

__all__ = ["SPMesh", "init_sequence_parallel"]
