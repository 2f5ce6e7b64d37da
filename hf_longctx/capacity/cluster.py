"""The cluster a setting is sized for: its GPUs, memory, and the throughput assumptions.

Where it sits: an input of `capacity/search.rank_settings` (GPU and host memory less the
headroom; the USP guidance that orders near ties) and of `capacity/step_time.step_time`
(peak FLOP/s at an MFU; per-GPU bandwidth inside a node, across nodes and over PCIe; a latency
per all-to-all call; the host memory traffic of a CPU optimizer step). Defaults: H100 SXM
nodes of 8 GPUs. Guarantees: a `Cluster` holds only values the models can use (counts >= 1,
rates > 0, mfu in (0, 1], headroom in [0, 1)), checked at construction.
Paper: USP §4 (Ulysses inside a node, ring across nodes)."""

from __future__ import annotations

from dataclasses import dataclass

from hf_longctx.ops.ulysses import kv_replication
from hf_longctx.capacity.estimate import Setting


@dataclass(frozen=True)
class Cluster:
    """The hardware and the throughput assumptions (see the module docstring)."""

    gpus: int
    gpu_memory: float  # bytes per GPU
    host_memory: float  # bytes per node
    gpus_per_node: int = 8
    tflops: float = 989.0  # dense bf16 peak per GPU (H100 SXM)
    mfu: float = 0.4
    intra_bw: float = 150e9  # bytes/s per GPU within a node (NVLink, all-to-all effective)
    inter_bw: float = 25e9  # bytes/s per GPU across nodes (e.g. 200 Gb/s NIC per GPU)
    pcie_bw: float = 25e9  # bytes/s per GPU host <-> device
    headroom: float = 0.1  # fraction of GPU / host memory kept free (context, fragmentation, model error)
    latency: float = 30e-6  # seconds per all-to-all call (what makes many FPDT chunks cost something)
    cpu_optim_bw: float = 10e9  # bytes/s per GPU of host memory traffic in a CPU optimizer step (param offload)

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("gpu_memory", "host_memory", "tflops", "intra_bw", "inter_bw", "pcie_bw", "cpu_optim_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom}")

    def bandwidth(self, span: int) -> float:
        """Per-GPU bandwidth of a group of `span` consecutive ranks."""
        return self.intra_bw if span <= self.gpus_per_node else self.inter_bw

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
