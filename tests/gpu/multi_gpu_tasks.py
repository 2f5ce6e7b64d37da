"""Per-rank tasks of tests/gpu/test_multi_gpu.py: the CPU tests' cases, run on this rank's GPU.

Where it sits: test harness only. Each function runs inside a worker of the NCCL pool
(`tests/helpers/pool.py`, `backend="nccl"`: rank r on cuda:r) and reuses the CPU tests' builders
(`tests/helpers/attention_cases.case_errors`, the bf16 step helpers of tests/helpers/bf16_rule.py,
`tests/helpers/trainer_cases.py`) with only the device changed: the problem and its float64 truth
are built on the host exactly as on CPU, the library under test only ever sees CUDA tensors.
"""

from __future__ import annotations

import functools

import torch

from tests.helpers.attention_cases import case_errors
from tests.helpers import bf16_rule
from tests.helpers.fpdt_cases import _boundaries
from tests.helpers.pool import worker_mesh
from tests.helpers.usp_cases import _lengths


def device() -> torch.device:
    """This rank's GPU; the host where there is none (only to dry-run the harness on gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def to_device(batch: dict, dev: torch.device) -> dict:
    """Every tensor of a (sharded) batch on `dev`; metadata objects unchanged."""
    return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# ---- attention: USP / FPDT forward + backward vs the float64 reference ---------------------


def _cuda_attention(attention, q, k, v, mesh, *, cu_seqlens=None, sinks=None, **kw):
    """`attention` on this rank's GPU: q/k/v [B, S_local, H, D], the boundaries and the sinks
    moved there (autograd carries the gradients back to the host leaves `case_errors` checks),
    the output [B, S_local, H, D] returned to the host with its strides (`.to` preserves the
    layout of a dense tensor, so `case_errors`' contiguity check still sees the kernel's)."""
    dev = device()
    extra = {} if sinks is None else {"sinks": sinks.to(dev)}
    cu = None if cu_seqlens is None else cu_seqlens.to(dev)
    out = attention(q.to(dev), k.to(dev), v.to(dev), mesh, cu_seqlens=cu, **kw, **extra)
    if out.device != dev:
        raise AssertionError(f"{attention.__name__} returned its output on {out.device}, inputs were on {dev}")
    return out.cpu()


def check_signatures() -> None:
    """Bind every library call these tasks make to its current signature (import time, so a
    CPU machine's collection fails on a renamed argument the GPU run would hit)."""
    import inspect

    from hf_longctx import LongContextTrainer, fsdp_plan, patch
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.distributed.gather import gather_sequence
    from hf_longctx.distributed.loss import global_loss
    from hf_longctx.ops.fpdt import fpdt_attention
    from hf_longctx.ops.usp import usp_attention

    x = object()
    calls = [
        (usp_attention, (x, x, x, x), dict(cu_seqlens=x, causal=x, window=x, softcap=x, sinks=x)),
        (fpdt_attention, (x, x, x, x), dict(cu_seqlens=x, causal=x, window=x, softcap=x, sinks=x, offload=x)),
        (fsdp_plan, (x, x), dict(mixed_precision="bf16")),
        (patch, (x, x), {}),
        (shard_batch, (x, x), dict(num_items_in_batch=x)),
        (gather_sequence, (x, x, x), {}),
        (global_loss, (x, x), dict(dp_reduce="none")),
        (LongContextTrainer.__init__, (x,), dict(model=x, args=x, train_dataset=x, mesh=x, max_tokens=x, tokens_per_step=x)),
        (case_errors, (x, x, x), dict(attention=x, cu=x, rows=x, head_dim=x, variants=x)),
        (bf16_rule.excess, (x, x, x, x, x), {}),
    ]
    for fn, args, kwargs in calls:
        try:
            inspect.signature(fn).bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"tests/gpu/multi_gpu_tasks.py calls {fn.__qualname__} in a way its signature refuses: {e}") from None


def usp_cases(ulysses: int, ring: int, dtype_name: str, cases: list[dict]) -> list[dict]:
    """tests/helpers/usp_cases.py's packing (uneven documents, multiples of doc_multiple) and shapes, on the GPU."""
    from hf_longctx.ops.usp import usp_attention

    mesh = worker_mesh(ulysses, ring)
    attention = functools.partial(_cuda_attention, usp_attention)
    out = []
    for case in cases:
        cu = None
        if case.get("packed", True):
            lengths = _lengths(mesh, case.get("seed", 0) + 1000 * mesh.dp_rank, case.get("docs", 4))
            cu = [0]
            for n in lengths:
                cu.append(cu[-1] + n)
        rows = (2, 8 * mesh.sp * max(mesh.doc_multiple, 2))
        out.append(case_errors(mesh, case, getattr(torch, dtype_name), attention=attention, cu=cu, rows=rows, head_dim=16))
    return out


def fpdt_cases(ulysses: int, chunks: int, dtype_name: str, cases: list[dict]) -> list[dict]:
    """tests/helpers/fpdt_cases.py's documents (straddling chunks), offload off and on ("off_": real pinned host
    copies on side streams here, the same numbers through the same schedule)."""
    from hf_longctx.ops.fpdt import fpdt_attention

    mesh = worker_mesh(ulysses, 1, chunks)
    attention = functools.partial(_cuda_attention, fpdt_attention)
    out = []
    for case in cases:
        seed = case.get("seed", 0) + 1000 * mesh.dp_rank
        cu = _boundaries(mesh, seed, case.get("docs", 4)) if case.get("packed", True) else None
        out.append(case_errors(
            mesh, case, getattr(torch, dtype_name), attention=attention, cu=cu, rows=(2, 2 * mesh.seq_multiple),
            head_dim=8, variants={"": dict(offload=False), "off_": dict(offload=True)},
        ))
    return out


# ---- a patched model under FSDP2 bf16 vs the single-GPU model -------------------------------


def single_gpu(path: str, dtype: torch.dtype) -> tuple:
    """g₁ of test_bf16: the unpatched model in one process, here on one GPU (weights in `dtype`,
    no autocast), all documents; per-token losses and gradients as float64 on the host."""
    model = bf16_rule._fresh(path, dtype).to(device())
    batch = bf16_rule._flat(bf16_rule._docs())
    out = model(**to_device(batch, device()), use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters()}
    return bf16_rule.token_losses(out.logits.detach(), batch["labels"].to(device())).cpu(), grads


def fsdp_step(path: str, degrees: tuple[int, int, int], truth: tuple, single: tuple) -> dict:
    """One training step of the patched model, loaded on the host, sharded by
    `fsdp_plan(mixed_precision="bf16").apply` (which places the shards on this GPU), the
    batch moved to the GPU; `bf16_rule.excess` of its tokens, loss and gradients."""
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.distributed.gather import gather_sequence
    from hf_longctx.integrations.accelerate import fsdp_plan
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.distributed.loss import global_loss

    mesh = worker_mesh(*degrees)
    dev = device()
    model = patch(bf16_rule._fresh(path, torch.float32), mesh)  # on the host
    fsdp_plan(model, mesh, mixed_precision="bf16").apply(model)
    batch = bf16_rule._flat(bf16_rule._docs()[mesh.dp_rank :: mesh.dp])
    shard = to_device(shard_batch(batch, mesh, num_items_in_batch=bf16_rule._targets()), dev)
    out = model(**shard)
    out.loss.backward()
    logits = gather_sequence(out.logits, shard, mesh)
    tokens = bf16_rule.token_losses(logits, batch["labels"].to(dev)).cpu()
    grads = {n: p.grad.full_tensor().double().cpu() for n, p in model.named_parameters()}
    loss = global_loss(out.loss, mesh, dp_reduce="none").cpu()
    return bf16_rule.excess(truth, single, (tokens, loss, grads), mesh.dp_rank, mesh.dp)


# ---- LongContextTrainer, bf16 ------------------------------------------------------------------


def trainer_run(path: str, degrees: tuple[int, int, int] | None, output_dir: str, steps: int) -> list:
    """`steps` logged (loss, grad_norm) of LongContextTrainer with bf16=True on the GPU: the
    same arguments, data and caps as tests/distributed/test_trainer.py. degrees None: one
    process without a group (the single-GPU reference, run in pytest's own process)."""
    from transformers import AutoModelForCausalLM

    from hf_longctx import LongContextTrainer, init_sequence_parallel, patch
    from tests.helpers.trainer_cases import history, make_dataset, training_args

    args = training_args(output_dir, bf16=True, use_cpu=not torch.cuda.is_available(), max_steps=steps)  # first: it adopts the group
    mesh = worker_mesh(*degrees) if degrees else init_sequence_parallel()
    model = patch(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), mesh)  # on the host
    trainer = LongContextTrainer(model=model, args=args, train_dataset=make_dataset(masked=True), mesh=mesh,
                                 max_tokens=48, tokens_per_step=120)
    try:
        trainer.train()
        return history(trainer)
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)  # the next task / test starts clean
