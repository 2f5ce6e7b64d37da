"""Every hardware constant of the step-time model, in one place, each with its source.

Where it sits: `capacity/cluster.Cluster.gpu` names an entry of `GPUS`; `capacity/roofline.py`
turns op streams into seconds with it; `capacity/mixers.py` and `ops/mixers/cost.py` take link
and launch seconds from it. Guarantees: the datasheet figures are peaks; what a kernel class
achieves is a fraction of a peak, each fraction from a kernel microbenchmark named beside it
(no constant is fitted to an end-to-end step time), and each entry says where its fractions
come from (`GPU.fractions`); an entry without measured fractions has none (A100): its step
time is refused (`step_time.UntimedGPU`), its memory plans stand. The fractions are the
torch.profiler kernel times of two H200 steps (2026-11-27, torch 2.11+cu130, torch's flash
ops, the code at 42880f9; benchmarks/results/gpu_throughput_{8b,1b}_h200.json) divided by the
work the inventory of that code counts for the same kernels: `benchmarks/gpu_model.py
--derive` reproduces them and tests/unit/test_gpu_derive.py holds them to it. H100 SXM and H200
are the same GH100 compute die (132 SMs, same clocks and bf16 peak): the H100 takes the
H200's compute-bound fractions, its memory-bound ops at its own HBM bandwidth."""

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
    fractions: str = ""  # where gemm, attention, hbm and launch_s come from; "": none measured (no step time)
    launch_s: float = 2.5e-6  # GPU-side time of a minimal kernel (launch, ramp, tail)
    collective_s: float = 30e-6  # latency of one NCCL collective call (assumed: no multi-GPU run profiled)
    gemm: float | None = 0.69  # achieved fraction of bf16_flops on the step's GEMMs (cuBLAS)
    attention: tuple = TORCH_FA2  # (head dim, fwd, bwd) of bf16_flops of the attention kernel modelled
    hbm: float | None = 0.56  # achieved fraction of hbm_bw on elementwise kernels
    nccl: float = 0.75  # achieved fraction of a link's bandwidth in all-to-all / p2p (literature, not measured here)
    # (attention backend, ((head dim, fwd, bwd), ...)) measured by kernel microbenchmarks on this GPU
    # (`benchmarks/gpu_attention_backends.py`); the backend names of `ops/backends/select.py`.
    measured_attention: tuple = ()
    attention_backend: str | None = None  # the backend modelled; None: the fastest measured at the call's head dim

    @property
    def timed(self) -> bool:
        """Whether this card has measured kernel fractions, so that its step time can be modelled."""
        return bool(self.fractions)

    def untimed(self) -> str:
        """Why the step time of this card is not modelled (what `hf-longctx plan --gpu` prints)."""
        return (f"no measured kernel fractions for {self.name}: the step time cannot be modelled; memory plans only "
                "(capacity/gpus.py; a profile of this card's kernels, as benchmarks/gpu_model.py --derive reads the "
                "H200's, would give them)")

    def attention_ranking(self, head_dim: int) -> tuple[str, ...]:
        """The backends measured on this GPU, fastest first at the nearest measured head dim
        (seconds per pair: 4 / fwd + 10 / bwd, the FLOPs of the forward and the backward)."""
        def seconds(rows) -> float:
            _, fwd, bwd = min(rows, key=lambda row: abs(row[0] - head_dim))
            return 4 / fwd + 10 / bwd

        return tuple(name for name, rows in sorted(self.measured_attention, key=lambda m: seconds(m[1])))

    def modelled_attention(self, head_dim: int) -> str:
        """The backend whose fractions `attention` holds: the one `with_attention_backend` set, else
        the fastest measured, else torch's flash ops."""
        ranking = self.attention_ranking(head_dim)
        return self.attention_backend or (ranking[0] if ranking else "torch_flash")

    def attention_fraction(self, head_dim: int, backward: bool) -> float:
        """The measured fraction of the nearest head dim (flash-attn's tiles depend on it)."""
        d, fwd, bwd = min(self.attention, key=lambda row: abs(row[0] - head_dim))
        return bwd if backward else fwd


# Sources:
# - bf16 dense peaks, HBM, NVLink, memory: NVIDIA H100 / H200 / A100 datasheets (SXM parts):
#   H100 989 TFLOP/s, 3.35 TB/s HBM3, NVLink 4 900 GB/s total = 450 GB/s per direction;
#   H200 989 TFLOP/s, 4.8 TB/s HBM3e, 141 GB; A100 312 TFLOP/s, 2.039 TB/s HBM2e, NVLink 3
#   600 GB/s total = 300 per direction.
# - IB: one 400 Gb/s NDR NIC per GPU (DGX H100 / H200) = 50 GB/s; 200 Gb/s HDR (DGX A100) = 25 GB/s.
# - PCIe (Gen5 x16 on H100/H200 hosts): the H200 profiles' pinned copies against the layer inputs the
#   inventory offloads: HtoD 55.0 / 55.1 GB/s (8B: 2 x 268 MB in 9.77 ms; 1B: 16 x 134 MB in 39.0 ms)
#   and DtoH 55.5 / 55.5 GB/s (`--derive`); A100 hosts are Gen4 x16: 25 GB/s (assumed: half of
#   Gen5's, not measured).
# - launch_s: not reproduced from committed data: the 1B profile's neg kernel takes 4.25 us a call,
#   of which 1.7 us were its bytes at peak bandwidth by the run's note (4 MB read and written),
#   which the committed top-kernel list cannot confirm; small device-to-device copies took 4.1 us.
# - gemm: cuBLAS GEMM kernel time of the 8B-width profile (0.333 s) against the GEMM FLOPs the
#   inventory counts for that step (`--derive`: 0.692; the 1B profile gives 0.731, not used);
#   attention: flash fwd / bwd kernel times per call (8B, head dim 128: 24.3 ms fwd, 76.6 ms bwd
#   at 32K causal; 1B, head dim 64: 14.0 / 38.7 ms) against 4 and 10 x pairs x H x D FLOPs;
#   hbm: the fp32 gradient-sum adds against their bytes: the 8B profile's 374 calls (0.2665 s)
#   give 0.566, the 1B profile's 2,302 give 0.559; 0.56 lies between them (the 8B figure alone
#   rounds to 0.57). The code as it is runs no such add; the profile of the code as it is gives
#   0.558 for its elementwise and copy classes (`--derive`), so the fraction stands.
# - collective_s: assumed, not measured: no multi-GPU run has been profiled; nccl: nccl-tests
#   all-to-all on 8 NVLink-4 GPUs reach about 3/4 of the per-direction link rate (published
#   figures, not measured here). Neither can be reproduced from the committed results.
# - A100: no kernel of it has been profiled; FlashAttention-2 reaches 50-73 % of its peak there
#   (the FlashAttention-2 paper, forward + backward), far from torch's port's 0.29-0.37 on the
#   H200, so no other card's fractions are carried to it: no step time, memory plans only.
# - measured_attention: the H200 kernel times of torch's flash ops (the attention line above), carried
#   to the H100 with the rest of its fractions. Nothing measured on an A100.
_H200_PROFILES = ("the H200 profiles of benchmarks/results/gpu_throughput_8b_h200.json and "
                  "gpu_throughput_1b_h200.json (benchmarks/gpu_model.py --derive)")
GPUS = {
    "h100": GPU("H100 SXM", 989e12, 3.35e12, 80e9, 450e9, 50e9, 55e9, 55e9,
                fractions="the H200's, carried over (same GH100 compute die); HBM-bound ops at the H100's bandwidth",
                measured_attention=(("torch_flash", TORCH_FA2),)),
    "h200": GPU("H200 SXM", 989e12, 4.8e12, 141e9, 450e9, 50e9, 55e9, 55e9, fractions="measured: " + _H200_PROFILES,
                measured_attention=(("torch_flash", TORCH_FA2),)),
    "a100": GPU("A100 SXM", 312e12, 2.039e12, 80e9, 300e9, 25e9, 25e9, 25e9, fractions="", gemm=None, attention=(),
                hbm=None),
}


def key_of_device(device_name: str) -> str | None:
    """The entry of `GPUS` a CUDA device name is ("NVIDIA H100 80GB HBM3" -> "h100"), or None for
    a part the table does not hold (an H100 PCIe or NVL has other clocks and memory)."""
    name = device_name.upper()
    if "PCIE" in name or "NVL" in name:
        return None
    return next((key for key in GPUS if key.upper() in name), None)


def with_attention_backend(spec: GPU, backend: str | None) -> GPU:
    """`spec` modelling `backend`: its measured rows as `attention` (None: the fastest measured at
    head dim 128, the width of the models planned; nothing measured: `spec` as it is). A backend
    not measured on the card is refused, never given another backend's fractions."""
    measured = dict(spec.measured_attention)
    if backend is not None and backend not in measured:
        raise ValueError(
            f"no measured attention fractions of {backend!r} on {spec.name} (measured: {list(measured) or 'none'}): "
            "run benchmarks/gpu_attention_backends.py on one and add its row to capacity/gpus.py, or model the default"
        )
    backend = backend or next(iter(spec.attention_ranking(128)), None)
    return spec if backend is None else replace(spec, attention=measured[backend], attention_backend=backend)


def gpu(name: str) -> GPU:
    """The entry of `GPUS` named `name` (case-insensitive); a clear error otherwise."""
    key = name.lower().replace(" ", "").replace("-", "").replace("sxm", "")
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}: the step-time model knows {sorted(GPUS)} (capacity/gpus.py)")
    return GPUS[key]
