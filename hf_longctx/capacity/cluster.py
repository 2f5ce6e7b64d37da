"""The cluster a setting is sized for: its GPUs, memory and links.

Where it sits: an input of `capacity/search.rank_settings` (GPU and host memory less the
headroom; the USP guidance that orders near ties) and of `capacity/step_time.step_time` (the
GPU named by `gpu`, an entry of `capacity/gpus.py` with its peaks and achieved fractions;
per-GPU bandwidth inside a node and across nodes, defaulting to that GPU's NVLink and
NIC; the host memory traffic of a CPU optimizer step). Defaults: H100 SXM nodes of 8 GPUs.
Guarantees: a `Cluster` holds only values the models can use (counts >= 1, rates > 0,
headroom in [0, 1), a known GPU, an attention backend measured on it), checked at construction.
Paper: USP §4 (Ulysses inside a node, ring across nodes)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hf_longctx.ops.ulysses import kv_replication
from hf_longctx.capacity.estimate import Setting
from hf_longctx.capacity.gpus import GPU, gpu as gpu_named, with_attention_backend


@dataclass(frozen=True)
class Cluster:
    """The hardware (see the module docstring). `intra_bw` / `inter_bw` / `pcie_bw` /
    `latency` left None take the GPU's (`capacity/gpus.py`); given, they replace it."""

    gpus: int
    gpu_memory: float  # bytes per GPU
    host_memory: float  # bytes per node
    gpus_per_node: int = 8
    gpu: str = "h100"  # an entry of capacity/gpus.GPUS
    intra_bw: float | None = None  # bytes/s per GPU and direction within a node (NVLink)
    inter_bw: float | None = None  # bytes/s per GPU and direction across nodes (NIC)
    pcie_bw: float | None = None  # bytes/s per GPU host <-> device
    headroom: float = 0.1  # fraction of GPU / host memory kept free (context, fragmentation, model error)
    latency: float | None = None  # seconds per collective call
    cpu_optim_bw: float = 10e9  # bytes/s per GPU of host memory traffic in a CPU optimizer step (param offload)
    attention_backend: str | None = None  # the attention kernel modelled (measured on `gpu`); None: the fastest measured

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        with_attention_backend(gpu_named(self.gpu), self.attention_backend)  # raises for an unknown GPU or backend
        for name in ("gpu_memory", "host_memory", "intra_bw", "inter_bw", "pcie_bw", "cpu_optim_bw", "latency"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom}")

    @property
    def gpu_spec(self) -> GPU:
        """The GPU's constants with this cluster's link overrides applied."""
        spec = gpu_named(self.gpu)
        given = {"nvlink_bw": self.intra_bw, "ib_bw": self.inter_bw, "pcie_h2d": self.pcie_bw, "pcie_d2h": self.pcie_bw,
                 "collective_s": self.latency}
        return with_attention_backend(replace(spec, **{k: v for k, v in given.items() if v is not None}),
                                      self.attention_backend)

    def bandwidth(self, span: int) -> float:
        """Per-GPU bandwidth of a group of `span` consecutive ranks (datasheet, per direction)."""
        spec = self.gpu_spec
        return spec.nvlink_bw if span <= self.gpus_per_node else spec.ib_bw

    def usp_ulysses(self, sp: int, heads: int | None = None, kv_heads: int | None = None) -> int:
        """The Ulysses degree the USP guidance gives an SP group of `sp` GPUs: as large as one
        node's GPUs (and the heads: `heads` divisible by it) allow, dividing `sp`."""
        best = 1
        for u in range(1, min(sp, self.gpus_per_node) + 1):
            if sp % u == 0 and (heads is None or _ulysses_ok(heads, kv_heads or heads, u)):
                best = u
        return best

    def follows_usp_guidance(self, s: Setting, heads: int | None = None, kv_heads: int | None = None) -> bool:
        """USP §4: Ulysses inside a node, as wide as the node (and the heads) allow; ring only
        across nodes, so an SP group within one node is pure Ulysses and a larger one is
        node-wide Ulysses times a ring over the nodes (every ring hop crosses nodes)."""
        return s.ulysses == self.usp_ulysses(s.sp, heads, kv_heads) and (s.ring == 1 or s.sp > self.gpus_per_node)


def _ulysses_ok(heads: int, kv_heads: int, u: int) -> bool:
    try:
        kv_replication(heads, kv_heads, u)
    except ValueError:
        return False
    return True
