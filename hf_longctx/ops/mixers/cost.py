"""What each sequence-parallel scheme of a linear mixer costs per layer, and the rule that picks one.

Where it sits: `integrations/mixers/modes.py` applies `choose` per mixer and micro-batch
(`patch(mixers="auto")`), `capacity/mixers.py` charges the chosen scheme in the step time
of `hf-longctx plan`, `benchmarks/mixers.py` prints both: one place for the formulas, so
the three cannot disagree. Pure Python.
Per layer and rank, forward + backward: the head all-to-all moves 2 · S_l·(P−1)/P ·
channels · b bytes; state passing moves the conv halo plus fp32 maps independent of S_l
(GDN also computes D_k extra state columns), counted per direction: the backward's scan runs
the chains in reverse (a rank's sends there are not its forward sends) and its halo sends back
the gradients of the rows the rank RECEIVED. The rule: the smaller bytes / bandwidth +
collectives · latency + extra FLOPs / rate; state passing whenever heads < P."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

CHUNK = 64  # the chunk length of the chunked delta-rule kernels (transformers' torch path, FLA)


@dataclass(frozen=True)
class MixerDims:
    """One linear mixer's sizes. kind "gdn": heads = H_v, groups = H_k, key_dim = D_k,
    head_dim = D_v; kind "mamba2": heads = H, groups = G, key_dim = N (state), head_dim = P_h."""

    kind: str
    heads: int
    groups: int
    key_dim: int
    head_dim: int
    kernel: int

    @property
    def conv_channels(self) -> int:
        """Channels of the short convolution: q and k (GDN) or B and C (Mamba-2) per group, and the
        value / x heads -- one formula for both kinds."""
        return 2 * self.groups * self.key_dim + self.heads * self.head_dim

    @property
    def map_numel(self) -> int:
        """|A| per row: a D_k × D_k transition per value head (GDN), a decay per head (Mamba-2)."""
        return self.heads * self.key_dim**2 if self.kind == "gdn" else self.heads

    @property
    def state_numel(self) -> int:
        """|X| per row: the recurrent state."""
        return self.heads * self.key_dim * self.head_dim

    def head_channels(self, sp: int) -> int:
        """Channels per token a rank sends in the head all-to-all (forward: in + out)."""
        out = self.heads * self.head_dim
        if self.kind == "gdn":  # q, k (replicated past H_k ranks), v, beta, a; the output back
            return 2 * max(self.groups, sp) * self.key_dim + self.heads * self.head_dim + 2 * self.heads + out
        return self.heads * self.head_dim + 2 * max(self.groups, sp) * self.key_dim + self.heads + out  # x, B, C, dt; y

    def extra_flops(self) -> float:
        """FLOPs per token that state passing adds (forward + backward ≈ 3 × forward)."""
        if self.kind == "gdn":  # D_k more value columns through the chunked kernel, then q̃ᵀ S_in
            dk, dv = self.key_dim, self.head_dim
            return 3.0 * self.heads * (4 * CHUNK * dk + 6 * dk * dk + 2 * dk * dv)
        return 3.0 * self.heads * 2 * self.key_dim * self.head_dim  # C_t · h_in per token


@dataclass(frozen=True)
class Traffic:
    bytes: float  # sent by one rank per layer, forward + backward
    calls: int  # collectives per layer, forward + backward
    flops: float  # compute the scheme adds per rank per layer

    def seconds(self, bandwidth: float, latency: float, flops_per_s: float) -> float:
        return self.bytes / bandwidth + self.calls * latency + self.flops / flops_per_s


def head_traffic(d: MixerDims, sp: int, s_local: float, elem_bytes: int, rows: int = 1) -> Traffic:
    return Traffic(2 * rows * s_local * (sp - 1) / sp * d.head_channels(sp) * elem_bytes, 4, 0.0)


def scan_rounds(chain_runs: int) -> int:
    """Rounds of the segmented scan for a chain of `chain_runs` runs (its maps: chain_runs − 1)."""
    return max(0, math.ceil(math.log2(max(chain_runs - 1, 1))))


@dataclass(frozen=True)
class Sends:
    """What one rank sends to other ranks in one direction of a state-passing layer: maps (A
    and X) in all scan rounds but the last, lone states (X: the last round and the shift), and
    conv halo rows (forward: its rows others read; backward: the gradients of the rows it read)."""

    maps: int
    states: int
    halo_rows: int


def state_traffic(
    d: MixerDims, *, forward: Sends, backward: Sends, rounds: int, s_local: float, elem_bytes: int, rows: int = 1,
) -> Traffic:
    """Bytes one rank sends in the forward scan + halo and in the backward's reverse scan +
    halo gradients; rounds: of the scan, -1 when no document spans two runs (then the scan
    issues no collective at all). Exact for the counted sends (`ChainPlan.sends`)."""
    def one(s: Sends) -> float:
        scan = 4 * rows * (s.maps * (d.map_numel + d.state_numel) + s.states * d.state_numel)
        return scan + rows * s.halo_rows * d.conv_channels * elem_bytes

    return Traffic(one(forward) + one(backward), 2 * (2 + rounds), rows * s_local * d.extra_flops())


def layout_state_traffic(d: MixerDims, lay, rank: int, elem_bytes: int, rows: int = 1) -> Traffic:
    """State passing of one layer on `rank` for the batch layout `lay` (`SequenceLayout`):
    its scan sends both ways (`ChainPlan.sends`) and its halo rows -- sent in the forward, the
    gradients of the rows it received sent back in the backward (`HaloPlan`)."""
    from hf_longctx.ops.mixers.state_passing import ChainPlan

    s = ChainPlan.of(lay).sends(rank)
    halo = lay.halo(d.kernel)
    out_rows = sum(len(halo.send_rows[rank][q]) for q in range(lay.sp) if q != rank)
    in_rows = sum(c for q, c in enumerate(halo.recv_counts[rank]) if q != rank)
    return state_traffic(d, forward=Sends(s["maps"], s["states"], out_rows),
                         backward=Sends(s["back_maps"], s["back_states"], in_rows), rounds=s["rounds"],
                         s_local=lay.local_length, elem_bytes=elem_bytes, rows=rows)


def busiest_state_traffic(d: MixerDims, lay, elem_bytes: int, rows: int = 1) -> Traffic:
    """The rank of `lay` that sends the most (forward + backward): what the step waits for."""
    return max((layout_state_traffic(d, lay, p, elem_bytes, rows) for p in range(lay.sp)), key=lambda t: (t.bytes, t.calls))


def one_document_state_traffic(d: MixerDims, ulysses: int, ring: int, s_local: float, elem_bytes: int, rows: int = 1) -> Traffic:
    """State passing for ONE document spanning the group (the planner's case), busiest rank: the
    sends of a one-document layout of this group (runs of `kernel` tokens, so every halo is
    whole; the bytes do not depend on the length), the extra FLOPs at `s_local` tokens."""
    t = busiest_state_traffic(d, _one_document(ulysses, ring, d.kernel), elem_bytes, rows)
    return Traffic(t.bytes, t.calls, rows * s_local * d.extra_flops())


@functools.lru_cache(maxsize=256)
def _one_document(ulysses: int, ring: int, kernel: int):
    """The layout of one document over the group (its plans cached on it for every later call)."""
    from hf_longctx.ops.mixers.layout import SequenceLayout

    return SequenceLayout((0, 2 * ulysses * ring * max(kernel, 2)), ring, ulysses)


@dataclass(frozen=True)
class Links:
    """What the rule weighs: the SP group's per-GPU bandwidth, the latency of one collective,
    the FLOP rate (defaults: `GroupCost.from_config`'s H100-class constants; NVLink inside a
    node, 40 GB/s across)."""

    bandwidth: float
    latency: float = 30e-6
    flops_per_s: float = 0.5 * 989e12

    @staticmethod
    def of_group(sp: int, ranks_per_node: int, intra: float = 300e9, inter: float = 40e9) -> "Links":
        return Links(intra if sp <= ranks_per_node else inter)


def choose(d: MixerDims, sp: int, heads: Traffic, state: Traffic, links: Links) -> str:
    """'heads' or 'state' for one mixer and micro-batch: state passing when the head
    all-to-all cannot split the heads over `sp` ranks, else the cheaper by the cost model."""
    if sp > d.heads:
        return "state"
    cost = lambda t: t.seconds(links.bandwidth, links.latency, links.flops_per_s)  # noqa: E731
    return "state" if cost(state) < cost(heads) else "heads"


def _first(config: Any, names: Sequence[str]):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return None


def mixers_of_config(config: Any) -> list[tuple[MixerDims, int]]:
    """[(dims, layers)] of the linear recurrences of a transformers config (none for a plain
    transformer): Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-hybrid) or Mamba-2 (Bamba,
    Granite-4 hybrid, Falcon-H1, Nemotron-H, Zamba2)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(_first(config, ("num_hidden_layers",)) or 0)
    types = _first(config, ("layer_types", "layers_block_type"))
    if types is not None:
        count = sum(t in ("linear_attention", "mamba", "hybrid") for t in types)
    elif getattr(config, "attn_layer_indices", None) is not None:  # Bamba
        count = layers - len(config.attn_layer_indices)
    else:  # Falcon-H1: attention and Mamba-2 side by side in every layer
        count = layers
    if getattr(config, "linear_num_value_heads", None):
        d = MixerDims("gdn", config.linear_num_value_heads, config.linear_num_key_heads, config.linear_key_head_dim,
                      config.linear_value_head_dim, config.linear_conv_kernel_dim)
        return [(d, count)] if count else []
    heads = _first(config, ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"))
    if heads is None:
        return []
    d = MixerDims(
        "mamba2", int(heads), int(_first(config, ("mamba_n_groups", "n_groups", "mamba_ngroups"))),
        int(_first(config, ("mamba_d_state", "ssm_state_size"))), int(_first(config, ("mamba_d_head", "mamba_head_dim", "mamba_headdim"))),
        int(_first(config, ("mamba_d_conv", "conv_kernel"))),
    )
    return [(d, count)] if count else []
