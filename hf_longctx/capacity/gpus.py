"""Every hardware constant of the step-time model, in one place, each with its source.

Where it sits: `capacity/cluster.Cluster.gpu` names an entry of `GPUS`; `capacity/roofline.py`
turns op streams into seconds with it; `capacity/mixers.py` and `ops/mixers/cost.py` take link
and launch seconds from it. Guarantees: the datasheet figures are peaks; what a kernel class
achieves is a fraction of a peak, each fraction from a kernel microbenchmark named beside it
(no constant is fitted to an end-to-end step time). The per-kernel fractions come from the
torch.profiler kernel times of one H200 (2026-11-27, torch 2.11+cu130, torch's flash ops;
benchmarks/results/gpu_throughput_*_h200.json), divided by the work the inventory counts for
the same kernels (`benchmarks/gpu_model.py --derive` prints the derivation). H100 SXM and H200
are the same GH100 compute die (132 SMs, same clocks and bf16 peak): compute-bound fractions
carry over; memory-bound ops scale with each card's HBM bandwidth."""

from __future__ import annotations

from dataclasses import dataclass, replace

# torch's flash ops (FlashAttention-2), (head dim, fwd, bwd) of bf16_flops: the H200 profile (Sources).
TORCH_FA2 = ((64, 0.317, 0.287), (128, 0.366, 0.290))


@dataclass(frozen=True)
class GPU:
    """One accelerator and its links. Bandwidths in bytes/s per GPU and direction."""

    name: str
    bf16_flops: float  # dense peak
    hbm_bw: float
    memory: float  # bytes
    nvlink_bw: float  # per direction
    ib_bw: float  # per GPU across nodes, per direction
    pcie_h2d: float  # achieved, pinned host memory
    pcie_d2h: float
    launch_s: float = 2.5e-6  # GPU-side time of a minimal kernel (launch, ramp, tail)
    collective_s: float = 30e-6  # latency of one NCCL collective call
    gemm: float = 0.69  # achieved fraction of bf16_flops on the step's GEMMs (cuBLAS)
    attention: tuple = TORCH_FA2  # (head dim, fwd, bwd) of bf16_flops where nothing is measured on this GPU
    hbm: float = 0.56  # achieved fraction of hbm_bw on elementwise kernels
    nccl: float = 0.75  # achieved fraction of a link's bandwidth in all-to-all / p2p
    # (attention backend, ((head dim, fwd, bwd), ...)) measured by kernel microbenchmarks on this GPU
    # (`benchmarks/gpu_attention_backends.py`); the backend names of `ops/backends/select.py`.
    measured_attention: tuple = ()
    attention_backend: str | None = None  # the backend modelled; None: the fastest measured at the call's head dim

    def attention_ranking(self, head_dim: int) -> tuple[str, ...]:
        """The backends measured on this GPU, fastest first at the nearest measured head dim
        (seconds per pair: 4 / fwd + 10 / bwd, the FLOPs of the forward and the backward)."""
        def seconds(rows) -> float:
            _, fwd, bwd = min(rows, key=lambda row: abs(row[0] - head_dim))
            return 4 / fwd + 10 / bwd

        return tuple(name for name, rows in sorted(self.measured_attention, key=lambda m: seconds(m[1])))

    def modelled_attention(self, head_dim: int) -> str:
        """The backend whose fractions the model uses: the named one, else the fastest measured,
        else torch's flash ops (whose H200 fractions `attention` holds)."""
        ranking = self.attention_ranking(head_dim)
        return self.attention_backend or (ranking[0] if ranking else "torch_flash")

    def attention_fraction(self, head_dim: int, backward: bool) -> float:
        """The measured fraction of the modelled backend at the nearest head dim (flash-attn's tiles depend on it)."""
        rows = dict(self.measured_attention).get(self.modelled_attention(head_dim), self.attention)
        d, fwd, bwd = min(rows, key=lambda row: abs(row[0] - head_dim))
        return bwd if backward else fwd


# Sources:
# - bf16 dense peaks, HBM, NVLink, memory: NVIDIA H100 / H200 / A100 datasheets (SXM parts):
#   H100 989 TFLOP/s, 3.35 TB/s HBM3, NVLink 4 900 GB/s total = 450 GB/s per direction;
#   H200 989 TFLOP/s, 4.8 TB/s HBM3e, 141 GB; A100 312 TFLOP/s, 2.039 TB/s HBM2e, NVLink 3
#   600 GB/s total = 300 per direction.
# - IB: one 400 Gb/s NDR NIC per GPU (DGX H100 / H200) = 50 GB/s; 200 Gb/s HDR (DGX A100) = 25 GB/s.
# - PCIe (Gen5 x16 on H100/H200 hosts): measured in the H200 profile, pinned Memcpy HtoD 134 MB in
#   2.05 ms (65 GB/s) and DtoH in 2.42 ms (55 GB/s); A100 hosts are Gen4 x16: 25 GB/s (half the
#   Gen5 figures' 64 GB/s theoretical ratio applied to Gen4's 32 GB/s).
# - launch_s: the H200 profile's smallest kernels (neg on 4 MB: 4.25 us, of which 1.7 us is
#   bandwidth; device-to-device memcpy of small buffers: 4.1 us incl. the copy).
# - gemm: cuBLAS GEMM kernel time of the 8B-width profile (0.333 s) against the GEMM FLOPs the
#   inventory counts for that step (`--derive`); attention: flash fwd / bwd kernel times per call
#   (8B, head dim 128: 24.3 ms fwd, 76.6 ms bwd at 32K causal; 1B, head dim 64: 14.0 / 38.7 ms)
#   against 4 and 10 x pairs x H x D FLOPs; hbm: the fp32 gradient-sum adds of the 8B profile
#   (374 calls, 0.2665 s) against their bytes (`--derive`).
# - nccl: nccl-tests all-to-all on 8 NVLink-4 GPUs reach about 3/4 of the per-direction link rate.
# - measured_attention: H200 kernel times of torch's flash ops (the attention line above); the H100
#   carries them by the same-die argument of the module docstring. Nothing measured on an A100.
GPUS = {
    "h100": GPU("H100 SXM", 989e12, 3.35e12, 80e9, 450e9, 50e9, 65e9, 55e9, measured_attention=(("torch_flash", TORCH_FA2),)),
    "h200": GPU("H200 SXM", 989e12, 4.8e12, 141e9, 450e9, 50e9, 65e9, 55e9, measured_attention=(("torch_flash", TORCH_FA2),)),
    "a100": GPU("A100 SXM", 312e12, 2.039e12, 80e9, 300e9, 25e9, 25e9, 25e9),
}


def key_of_device(device_name: str) -> str | None:
    """The entry of `GPUS` a CUDA device name is ("NVIDIA H100 80GB HBM3" -> "h100"), or None for
    a part the table does not hold (an H100 PCIe or NVL has other clocks and memory)."""
    name = device_name.upper()
    if "PCIE" in name or "NVL" in name:
        return None
    return next((key for key in GPUS if key.upper() in name), None)


def with_attention_backend(spec: GPU, backend: str | None) -> GPU:
    """`spec` modelling `backend` (None: the fastest measured); a backend not measured on it is
    refused, never given another backend's fractions."""
    measured = [name for name, _ in spec.measured_attention]
    if backend is not None and backend not in measured:
        raise ValueError(
            f"no measured attention fractions of {backend!r} on {spec.name} (measured: {measured or 'none'}): run "
            "benchmarks/gpu_attention_backends.py on one and add its row to capacity/gpus.py, or model the default"
        )
    return replace(spec, attention_backend=backend)


def gpu(name: str) -> GPU:
    """The entry of `GPUS` named `name` (case-insensitive); a clear error otherwise."""
    key = name.lower().replace(" ", "").replace("-", "").replace("sxm", "")
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}: the step-time model knows {sorted(GPUS)} (capacity/gpus.py)")
    return GPUS[key]
