"""Seconds of an op stream on a named GPU: a roofline per op, links, and the overlaps the code has.

Where it sits: `capacity/step_time.step_time` hands it the inventory of one micro-batch
(`capacity/inventory.py`), `benchmarks/gpu_model.py` a recorded stream; both come back as a
`Breakdown`. Per op on the compute stream: max(FLOPs / achieved rate of its kernel class,
HBM bytes / achieved bandwidth) + one launch (`capacity/gpus.py`); an all-to-all there is
latency + bytes / link bandwidth and blocks the stream (`distributed/comm.py` waits for it).
What the code overlaps, per decoder layer: the host-offload copies of `ops/offload.py` run on
two side streams (one per direction): device-to-host under the layer's compute, each
host-to-device prefetch under the compute issued after it in the stream (where the code
issues it: memory="max" fetches the next layer's input after this layer's attention
backward, so only the pre-attention backward hides it); the ring's P2P sends
(`ops/ring.py`) run under that layer's attention kernels; FSDP2's all-gather and
reduce-scatter are prefetched on their own streams under the layer's compute. Each shows
only where it is longer than what covers it."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_longctx.capacity.gpus import GPU
from hf_longctx.capacity.op_cost import ATTN_BWD, ATTN_FWD, COLLECTIVE, D2H, GEMM, H2D, P2P, Op


@dataclass(frozen=True)
class Links:
    """Per-GPU bandwidth of each link the stream names (bytes/s, per direction)."""

    bandwidth: dict = field(default_factory=dict)  # "ulysses" / "ring" / "fsdp" / "world" -> bytes/s

    def of(self, link: str, gpu: GPU) -> float:
        return self.bandwidth.get(link, gpu.nvlink_bw) * gpu.nccl


@dataclass
class Breakdown:
    """Seconds of one micro-batch by what they are spent on; `binds` names the largest."""

    gpu: GPU
    flops: float = 0.0  # compute-bound op time (GEMM, attention)
    attention: float = 0.0  # of which the flash-attn kernels (the share a faster attention kernel would cut)
    attention_flops: float = 0.0  # their FLOPs (4 / 10 x pairs x H x D forward / backward)
    hbm: float = 0.0  # memory-bound op time
    launches: float = 0.0  # per-kernel overhead
    links: dict = field(default_factory=dict)  # exposed seconds per link ("ulysses", "ring", "fsdp", "pcie")
    other: dict = field(default_factory=dict)  # e.g. a CPU optimizer step
    model_flops: float = 0.0  # 6 N T + attention, the MFU numerator (per GPU)
    kernels: float = 0.0  # kernel launches per micro-batch

    @property
    def seconds(self) -> float:
        return self.flops + self.hbm + self.launches + sum(self.links.values()) + sum(self.other.values())

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.seconds * self.gpu.bf16_flops) if self.seconds else 0.0

    @property
    def terms(self) -> dict:
        """Seconds by what they are spent on: the compute-bound time split into the attention
        kernels and the GEMMs (their achieved fractions differ, and so does what would speed
        them up), then HBM, launches, each link's exposed time, PCIe and the other terms."""
        return {"attention kernels": self.attention, "GEMMs": self.flops - self.attention, "HBM": self.hbm,
                "launches": self.launches,
                **{("PCIe" if k == "pcie" else f"link {k}"): v for k, v in self.links.items()}, **self.other}

    @property
    def binds(self) -> str:
        """"attention kernels", "GEMMs", "HBM", "launches", "link <name>", "PCIe" or another
        term of `terms`: the largest."""
        terms = self.terms
        return max(terms, key=terms.get)

    def add(self, other: "Breakdown", times: float = 1.0) -> None:
        self.flops += times * other.flops
        self.attention += times * other.attention
        self.attention_flops += times * other.attention_flops
        self.hbm += times * other.hbm
        self.launches += times * other.launches
        self.kernels += times * other.kernels
        for d, o in ((self.links, other.links), (self.other, other.other)):
            for k, v in o.items():
                d[k] = d.get(k, 0.0) + times * v


def _compute(op: Op, gpu: GPU, head_dim: int) -> tuple[float, float]:
    """(compute-bound, memory-bound) seconds of one call: the larger of the two counts."""
    if op.kind == GEMM:
        rate = gpu.gemm * gpu.bf16_flops
    elif op.kind in (ATTN_FWD, ATTN_BWD):
        rate = gpu.attention_fraction(head_dim, op.kind == ATTN_BWD) * gpu.bf16_flops
    else:
        rate = 0.0
    t_f = op.flops / rate if rate else 0.0
    t_b = op.bytes / (gpu.hbm * gpu.hbm_bw)
    return (t_f, 0.0) if t_f >= t_b else (0.0, t_b)


def seconds(ops: list[Op], gpu: GPU, links: Links, head_dim: int) -> Breakdown:
    """One stretch of the stream (a decoder layer, or what the step runs outside its layers)
    with the overlaps of the module docstring applied inside it."""
    out = Breakdown(gpu)
    d2h = fetched = 0.0  # the D2H stream's busy seconds; when the H2D stream's last copy lands
    p2p = fsdp = attention = 0.0
    for op in ops:
        n = op.count
        if op.kind in (H2D, D2H):
            t = op.bytes / (gpu.pcie_h2d if op.kind == H2D else gpu.pcie_d2h)
            if op.stream == "side" and op.kind == D2H:
                d2h += n * t
            elif op.stream == "side":  # issued where it stands in the stream, behind the H2D copies before it
                now = out.flops + out.hbm + out.launches + sum(out.links.values())
                fetched = max(fetched, now) + n * t
            else:  # a copy on the compute stream (small metadata)
                out.links["pcie"] = out.links.get("pcie", 0.0) + n * (t + gpu.launch_s)
            continue
        if op.kind == P2P:
            p2p += n * (gpu.collective_s + op.wire / links.of(op.link, gpu))
            continue
        if op.kind == COLLECTIVE:
            t = gpu.collective_s + op.wire / links.of(op.link, gpu)
            if op.stream == "side":  # FSDP's prefetched all-gather / reduce-scatter
                fsdp += n * t
            else:
                out.links[op.link] = out.links.get(op.link, 0.0) + n * t
            continue
        t_f, t_b = _compute(op, gpu, head_dim)
        out.flops += n * t_f
        out.hbm += n * t_b
        out.launches += n * gpu.launch_s
        out.kernels += n
        if op.kind in (ATTN_FWD, ATTN_BWD):
            attention += n * (t_f + t_b)
            out.attention += n * t_f
            out.attention_flops += n * op.flops
    compute = out.flops + out.hbm + out.launches + sum(out.links.values())
    # A stretch's D2H copies need only keep pace with its compute; what it fetches (H2D) is read
    # by the next stretch, so only the compute issued after each fetch hides it.
    exposed = {"pcie": max(0.0, d2h - compute, fetched - compute), "ring": max(0.0, p2p - attention),
               "fsdp": max(0.0, fsdp - compute)}
    for k, v in exposed.items():
        if v > 0:
            out.links[k] = out.links.get(k, 0.0) + v
    return out
