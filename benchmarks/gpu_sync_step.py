"""Patched training steps on one GPU under `torch.cuda.set_sync_debug_mode("error")`.

Where it sits: a step of `make gpu-check` (`benchmarks/gpu_check.py` runs it in a bounded
subprocess). What `benchmarks/hot_path.py` counts on CPU by emulation -- no host sync in a
step -- checked by CUDA itself: after a warm-up step, every configuration runs one forward +
backward with torch's sync debug mode set to "error", which raises at the first operation
that makes the host wait for the device (`.item()`, a pageable copy, `nonzero`, a stream
synchronisation). Configurations: the local kernel, FPDT with K/V offload (the CUDA
offload code: pinned buffers, side stream, events), the memory presets "high" (kept
attention on the host) and "max" (offloaded checkpointing), and the linear-mixer hybrids
(conv, Gated DeltaNet, Mamba-2, RG-LRU), one process (SP = 1; the collectives are the
multi-GPU tests' part). Prints one row per configuration; exits 1 if any step synchronised
or failed.

Run: python benchmarks/gpu_sync_step.py [--tokens 8192]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROW = "SYNC_STEP_ROW "  # prefix of the lines gpu_check.py puts in its table
# (label, patch options, FPDT chunks, model family of benchmarks/hot_path.model_config)
CASES = [
    ("local kernel", {}, 1, "llama"),
    ("FPDT u=4 + KV offload", {"kv_offload": True}, 4, "llama"),
    ("memory='high' (u=4)", {"memory": "high"}, 4, "llama"),
    ("memory='max' (u=4)", {"memory": "max"}, 4, "llama"),
    ("conv: LFM2", {}, 1, "lfm2"),
    ("GDN: Qwen3.5", {}, 1, "qwen3_5"),
    ("Mamba-2: Bamba", {}, 1, "bamba"),
    ("RG-LRU: RecurrentGemma", {}, 1, "recurrent_gemma"),
]


def _batch(tokens: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    docs = [tokens // 2, tokens // 4, tokens // 8, tokens - tokens // 2 - tokens // 4 - tokens // 8]
    ids = torch.randint(3, vocab, (1, tokens), generator=g)
    pos = torch.cat([torch.arange(n) for n in docs])[None]  # [1, S] per-document positions
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def _first_frame_of_ours(exc: BaseException) -> str:
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if "hf_longctx" in frame.filename or "transformers" in frame.filename:
            return f"{os.path.basename(frame.filename)}:{frame.lineno} ({frame.name})"
    return "?"


def run_case(label: str, options: dict, chunks: int, family: str, tokens: int, device: str = "cuda") -> tuple[bool, str]:
    """(no sync, the row's text) of one configuration; `device="cpu"` runs the same calls
    without the sync check (the CPU contract test)."""
    from benchmarks.hot_path import model_config
    from hf_longctx import init_sequence_parallel, patch, shard_batch
    from transformers import AutoModelForCausalLM

    cuda = device == "cuda"
    torch.manual_seed(0)
    cfg = model_config(family, 4)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    mesh = init_sequence_parallel(fpdt_chunks=chunks)
    patch(model, mesh, **options)
    model.train()
    shard = shard_batch(_batch(tokens, cfg.vocab_size), mesh, device=device)
    model(**shard).loss.backward()  # warm-up: lazy initialisation (cuBLAS handles, pinned pools) outside the check
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    t0 = time.perf_counter()
    try:
        model(**shard).loss.backward()
    except RuntimeError as exc:
        if "synchroniz" not in str(exc):
            raise
        return False, f"SYNC at {_first_frame_of_ours(exc)}: {str(exc).splitlines()[0]}"
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    if cuda:
        torch.cuda.synchronize()
    return True, f"0 syncs ({tokens} tokens, {time.perf_counter() - t0:.2f} s)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    failed = False
    for label, options, chunks, family in CASES:
        try:
            ok, text = run_case(label, options, chunks, family, args.tokens)
        except Exception as exc:  # noqa: BLE001 -- every failure is a row, the next case still runs
            traceback.print_exc()
            ok, text = False, f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        failed |= not ok
        print(f"{ROW}{label}\t{text}", flush=True)
        torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
