"""`verify(model, mesh)`: measure, for THIS model, that sequence parallelism is exact.

Where it sits: beside `patch()` (`verify=True`), the numerical backstop of the structural
rule for untried families (invariant 7). On a reduced copy (one decoder layer per kind, the
rest identities, eval mode) it compares, in fp32, the unpatched copy on each document alone
with a patched copy (structural rule off) on a packed batch across the SP group: loss
within 1e-5 relative, every gradient within 1e-4 of the largest reference gradient. The
model itself is never touched (parameters, gradients, mode, RNG, attention implementation).
Cost: 2 × P_v × 8 B and ~12 × P_v × T FLOPs (P_v: embeddings, head, one layer per kind;
T = 16 × SP tokens): ~8 GB and ~0.8 TFLOP for a 7B Llama on SP 8."""

from __future__ import annotations

import copy

import torch

from hf_longctx.model_walk import hf_model, reduced_copy

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4


class VerificationError(ValueError):
    """The patched model differs from the unpatched one beyond fp32 tolerance (`verify`)."""


def _batch(vocab: int, sp: int):
    lens = [5 * sp + 1, 8 * sp + 3, 3, 3 * sp - 1]  # one document spans several shards; odd lengths
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, vocab, (n,), generator=g) for n in lens]
    ids = torch.cat(docs)[None]  # [1, T]
    pos = torch.cat([torch.arange(n) for n in lens])[None]  # [1, T]
    return docs, {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def verify(model, mesh, *, loss_tol: float = LOSS_TOL, grad_tol: float = GRAD_TOL, mixers=None) -> dict:
    """Raise `VerificationError` naming the worst parameter when SP is not exact for `model`.

    Call it on every rank of the SP group (it runs collectives over it), on a model that is
    not patched yet and not wrapped by FSDP (or use `patch(..., verify=True)`). It runs a
    reduced copy of the model (one decoder layer per kind) in fp32, patched and unpatched, on
    the same packed batch. (Long because this docstring documents each argument and the result.)

    Args:
        model (PreTrainedModel): The model, before `patch()` and before FSDP.
        mesh (SPMesh): The mesh it will be patched with.
        loss_tol: The largest relative error of the loss taken as exact.
        grad_tol: The largest gradient error, relative to the largest reference gradient, taken as exact.
        mixers (str | dict | None): The `patch(mixers=...)` scheme of a hybrid model's recurrences to measure.

    Returns:
        {"loss": relative error, "grad": worst gradient error, "worst": parameter name}.

    Raises:
        VerificationError: SP is not exact for `model` (the worst parameter named).
        ValueError: The model is already patched or wrapped by FSDP.
    """
    import torch.distributed as dist

    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import is_patched, patch, unpatch

    hf = hf_model(model)
    if is_patched(hf):
        raise ValueError("verify() needs the model before patch(): call it first, or patch(model, mesh, verify=True)")
    if any(type(p).__name__ == "DTensor" for p in hf.parameters()):
        raise ValueError("verify() needs the model before FSDP wraps it (its parameters are DTensors); call it before fully_shard")
    meta = any(p.is_meta for p in hf.parameters())
    if mesh.sp > 1:  # rank 0 may hold real weights while the others are on meta: every rank must agree first
        from hf_longctx.distributed.loss import collective_device

        flag = torch.tensor([int(meta)], device=collective_device(mesh.sp_group))  # [1]
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.sp_group)  # [1]: 1 if any rank is on meta
        meta = bool(flag.item())
    if meta:
        raise ValueError(
            "verify() needs real weights on every rank of the SP group, but some rank's model is on the meta device "
            "(e.g. loaded for broadcast_from_rank0); verify a model loaded on every rank, or patch without verify=True"
        )
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    sp_model = None
    try:
        ref = reduced_copy(hf)
        sp_model = copy.deepcopy(ref)
        device = next(ref.parameters()).device
        docs, batch = _batch(ref.get_input_embeddings().num_embeddings, mesh.sp)
        n_valid = sum(d.numel() - 1 for d in docs)
        loss_ref = 0
        for d in docs:  # reference: every document alone, normalised by the packed batch's count
            d = d[None].to(device)
            loss_ref = loss_ref + ref(input_ids=d, labels=d, use_cache=False).loss * (d.numel() - 1) / n_valid
        loss_ref.backward()
        patch(sp_model, mesh, mixers=mixers, unsafe_skip_exactness_check=True)
        loss = sp_model(**shard_batch(batch, mesh, device=device)).loss  # laid out on the host, copied once
        loss.backward()
        names = [n for n, p in ref.named_parameters() if p.requires_grad]
        sp_params = dict(sp_model.named_parameters())
        grads = [sp_params[n].grad if sp_params[n].grad is not None else torch.zeros_like(sp_params[n]) for n in names]
        flat = torch.cat([loss.detach().reshape(1)] + [g.reshape(-1) for g in grads])  # [1 + P_v]
        if mesh.sp > 1:
            dist.all_reduce(flat, group=mesh.sp_group)  # SP ranks' losses and gradients SUM to one device's
        ref_params = dict(ref.named_parameters())
        top = max((ref_params[n].grad.abs().max().item() for n in names if ref_params[n].grad is not None), default=0.0) or 1e-30
        loss_err = abs(flat[0].item() - loss_ref.item()) / max(abs(loss_ref.item()), 1e-30)
        worst, worst_name, off = 0.0, "", 1
        for n in names:
            p = ref_params[n]
            g_sp = flat[off : off + p.numel()].view_as(p)
            off += p.numel()
            g_ref = p.grad if p.grad is not None else torch.zeros_like(p)
            err = (g_sp - g_ref).abs().max().item() / top if p.numel() else 0.0
            if err > worst:
                worst, worst_name = err, n
    finally:
        if sp_model is not None and is_patched(sp_model):  # its attention/mask registrations and mixer wrappers
            unpatch(sp_model)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    result = {"loss": loss_err, "grad": worst, "worst": worst_name}
    if loss_err > loss_tol or worst > grad_tol:
        raise VerificationError(
            f"sequence parallelism is NOT exact for {type(hf).__name__}: worst parameter {worst_name!r} has a gradient "
            f"error of {worst:.2e} of the largest gradient (tolerance {grad_tol:.0e}), loss relative error {loss_err:.2e} "
            f"(tolerance {loss_tol:.0e}), fp32, on a copy with one layer per kind over SP {mesh.sp}; do not train this "
            "model with hf_longctx"
        )
    return result
