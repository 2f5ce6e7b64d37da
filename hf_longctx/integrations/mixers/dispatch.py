"""The sequence-mixing core of a GDN or Mamba-2 wrapper, under the scheme of this micro-batch.

Where it sits: `wrappers.py` computes the module's own projections, calls `gdn_core` /
`mamba2_core` here, and finishes with the module's own norm and output projection. The
scheme comes from `MixerBinding.scheme` (`modes.py`: the option of `patch(mixers=...)` or
the cost rule); both schemes are exact for packed documents under any layout.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hf_longctx._compat import fla_gated_delta_rule, mamba_ssm_chunk_scan
from hf_longctx.integrations.mixers.binding import MixerBinding
from hf_longctx.ops.mixers.gdn import GDNHeads, gdn_sequence_parallel
from hf_longctx.ops.mixers.gdn_state import gdn_state_passing
from hf_longctx.ops.mixers.layout import SequenceLayout
from hf_longctx.ops.mixers.mamba2 import Mamba2Heads, mamba2_sequence_parallel
from hf_longctx.ops.mixers.mamba2_state import mamba2_state_passing


def takes_cu_seqlens(core: Callable) -> bool:
    """The module file's `torch_chunk_gated_delta_rule` is flash-linear-attention's varlen
    kernel: transformers' hub-kernel decorator (`__wrapped__`) resolved it to FLA. A bare
    torch path would ignore `cu_seqlens` in its **kwargs, so both conditions are needed."""
    return hasattr(core, "__wrapped__") and fla_gated_delta_rule()


def takes_seq_idx(scan: Callable) -> bool:
    """The module file's `mamba2_chunk_scan` is mamba_ssm's `mamba_chunk_scan_combined` (the
    hub-kernel decorator resolved it), which keeps packed documents apart with `seq_idx`; the
    torch path refuses `seq_idx`."""
    return hasattr(scan, "__wrapped__") and mamba_ssm_chunk_scan()


def gdn_core(module: Any, bind: MixerBinding, lay: SequenceLayout, mixed_qkv, beta, a, activation, core) -> torch.Tensor:
    """core_out [B, S_local, H_v, D_v] of a Gated DeltaNet layer (see `ops/mixers/gdn*.py`)."""
    common = dict(conv_weight=module.conv1d.weight.squeeze(1), conv_bias=module.conv1d.bias, activation=activation,
                  A_log=module.A_log, dt_bias=module.dt_bias, head_k_dim=module.head_k_dim, head_v_dim=module.head_v_dim,
                  core=core, lay=lay, rank=bind.rank, group=bind.group)
    if bind.scheme(module, mixed_qkv.dtype) == "state":
        return gdn_state_passing(mixed_qkv, beta, a, k_heads=module.num_k_heads, varlen=takes_cu_seqlens(core), **common)
    heads = bind.split(module, lambda sp: GDNHeads.split(module.num_k_heads, module.num_v_heads, sp))
    return gdn_sequence_parallel(mixed_qkv, beta, a, heads=heads, varlen=takes_cu_seqlens(core), **common)


def mamba2_core(module: Any, bind: MixerBinding, lay: SequenceLayout, xbc, dt, activation, scan) -> torch.Tensor:
    """y [B, S_local, H·P_h] fp32 of a Mamba-2 layer before its gated norm (see `ops/mixers/mamba2*.py`)."""
    common = dict(conv_weight=module.conv1d.weight.squeeze(1), conv_bias=module.conv1d.bias, activation=activation,
                  A_log=module.A_log, D=module.D, dt_bias=module.dt_bias, dt_limit=tuple(module.time_step_limit),
                  head_dim=module.head_dim, state=module.ssm_state_size, chunk_size=module.chunk_size, scan=scan,
                  lay=lay, rank=bind.rank, group=bind.group)
    if bind.scheme(module, xbc.dtype) == "state":
        return mamba2_state_passing(xbc, dt, heads=module.num_heads, groups=module.n_groups, **common)
    heads = bind.split(module, lambda sp: Mamba2Heads.split(module.num_heads, module.n_groups, sp))
    return mamba2_sequence_parallel(xbc, dt, heads=heads, varlen=takes_seq_idx(scan), **common)
