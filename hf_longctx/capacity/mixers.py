"""The linear recurrences of a hybrid model in the planner's step-time model: both schemes, the cheaper charged.

Where it sits: `capacity/search.rank_settings` adds `mixer_seconds` to every setting's
step time; `mixer_schemes` is the per-mixer breakdown. The byte counts and the rule are
`ops/mixers/cost.py`'s (what `patch(mixers="auto")` applies), evaluated for ONE document
of `tokens` spanning the SP group (state passing's worst case); bytes become seconds by
`mixer_links`, the step-time model's constants (`capacity/gpus.py`: the group's link at the
achieved NCCL fraction, one collective's latency, the achieved GEMM rate) -- the same links
`patch(mixers="auto")` weighs at run time (`integrations/mixers/binding.py`). A recomputed
forward sends the forward half again. Not overlapped with compute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hf_longctx.ops.mixers.cost import Links, MixerDims, choose, head_traffic, mixers_of_config, one_document_state_traffic
from hf_longctx.capacity.estimate import DTYPE_BYTES, Setting
from hf_longctx.capacity.gpus import GPU, gpu as gpu_named


def mixer_links(sp: int, ranks_per_node: int, gpu: GPU | str = "h100") -> Links:
    """The seconds side of the mixers' cost rule from the step-time model's constants: the
    SP group's link (NVLink inside a node, the NIC across) at the achieved NCCL fraction,
    one collective's latency, the achieved GEMM rate of `gpu`."""
    g = gpu_named(gpu) if isinstance(gpu, str) else gpu
    link = g.nvlink_bw if sp <= ranks_per_node else g.ib_bw
    return Links(link * g.nccl, g.collective_s, g.gemm * g.bf16_flops)


@dataclass(frozen=True)
class MixerScheme:
    dims: MixerDims
    layers: int
    scheme: str  # "heads" | "state": what patch(mixers="auto") runs for this micro-batch
    heads_seconds: float | None  # per layer; None where the head all-to-all cannot split the heads
    state_seconds: float  # per layer

    @property
    def seconds(self) -> float:
        """All layers of this mixer, with the chosen scheme."""
        per_layer = self.state_seconds if self.scheme == "state" else self.heads_seconds
        return self.layers * per_layer


def mixer_schemes(config: Any, s: Setting, cluster: Any, tokens: int, dtype: str = "bf16") -> list[MixerScheme]:
    """Per linear recurrence of `config` (none for a plain transformer): both schemes' seconds
    per layer for a micro-batch of `tokens` on setting `s`, and the one the rule picks."""
    elem = DTYPE_BYTES[dtype]
    links = mixer_links(s.sp, cluster.gpus_per_node, cluster.gpu_spec)
    passes = 1.5 if s.checkpoint is True else 1.0  # a recomputed forward sends the forward half again
    s_local = tokens / s.sp
    out = []
    for dims, layers in mixers_of_config(config):
        heads = head_traffic(dims, s.sp, s_local, elem)
        state = one_document_state_traffic(dims, s.ulysses, s.ring, s_local, elem)
        secs = lambda t: passes * t.seconds(links.bandwidth, links.latency, links.flops_per_s)  # noqa: E731
        scheme = choose(dims, s.sp, heads, state, links) if s.sp > 1 else "heads"
        out.append(MixerScheme(dims, layers, scheme, None if s.sp > dims.heads else secs(heads) if s.sp > 1 else 0.0,
                               secs(state) if s.sp > 1 else 0.0))
    return out


def mixer_seconds(config: Any, s: Setting, cluster: Any, tokens: int, dtype: str = "bf16") -> float:
    """Seconds the linear recurrences add to one micro-batch (the chosen scheme of each)."""
    return sum(m.seconds for m in mixer_schemes(config, s, cluster, tokens, dtype))
