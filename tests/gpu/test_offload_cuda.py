"""FPDT's offload double buffer (`ops/offload.ChunkStore`) with real CUDA streams: chunks
come back bit-exact, and the host<->device copies hide behind compute. Prints the
fraction of copy time hidden (1 = fully overlapped)."""

import time

import torch

from hf_longctx.ops.offload import ChunkStore


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def hidden_fraction(n_chunks: int = 8, mib: int = 256) -> tuple[float, float, float, float]:
    """(fraction hidden, copy-only s, compute-only s, overlapped s) of streaming n chunks back."""
    chunks = [torch.randn(mib << 18, device="cuda") for _ in range(n_chunks)]  # mib MiB of fp32 each
    store = ChunkStore("cuda", offload=True)
    for i, c in enumerate(chunks):
        store.put(i, c)
    store.finish()
    a = torch.randn(4096, 4096, device="cuda")

    def compute():
        for _ in range(6):
            a @ a

    def copy_only():
        for _ in store.stream([[i] for i in range(n_chunks)]):
            pass

    def both():
        for _ in store.stream([[i] for i in range(n_chunks)]):
            compute()

    copy_only(), both()  # warm-up
    t_copy, t_comp = _timed(copy_only), n_chunks * _timed(compute)
    t_both = _timed(both)
    for (i,), (got,) in store.stream([[i] for i in range(n_chunks)]):
        assert torch.equal(got, chunks[i])
    return max(0.0, (t_copy + t_comp - t_both) / t_copy), t_copy, t_comp, t_both


def test_offload_copies_overlap_compute():
    frac, t_copy, t_comp, t_both = hidden_fraction()
    print(f"offload double buffer: copy {t_copy * 1e3:.1f} ms, compute {t_comp * 1e3:.1f} ms, "
          f"both {t_both * 1e3:.1f} ms, hidden {100 * frac:.0f}% of copy time")
    assert frac > 0.5, f"only {100 * frac:.0f}% of the copy time is hidden behind compute"
