"""bf16 training steps of patched models in the three mixed-precision regimes, vs float64 truth.

Regimes (each on its own):
- "autocast": fp32 weights, the step under `torch.autocast("cpu", dtype=torch.bfloat16)`
  (what Accelerate `mixed_precision="bf16"` and Trainer `bf16=True` do);
- "fsdp": fp32 weights sharded by `fsdp_plan(..., mixed_precision="bf16").apply` (FSDP2
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`), no autocast;
- "bf16": weights loaded in bf16 (`from_pretrained(dtype=torch.bfloat16)`), no autocast;
  gradients summed by `sum_gradients`.

Criterion, per gradient tensor and for the loss:
    ‖g − g64‖ ≤ 2·‖g₁ − g64‖ + 1e-6·‖g64‖
g64: the unpatched model in float64 on the same weights (fp32 master weights for
"autocast"/"fsdp", the bf16-rounded ones for "bf16") -- the truth. g₁: the unpatched model in
ONE process in the same regime (autocast over fp32 weights; bf16 weights for "fsdp", which is
what FSDP's bf16 all-gather computes with, and for "bf16"). So the SP run may be at most twice
as far from the truth as bf16 itself is: an extra bf16 rounding of a partial result (ring/FPDT
outputs before the fp32 merge, a bf16 gradient sum over ranks) or a wrong cast shows as an
error of the size of g₁'s, while an exact implementation sits at about g₁'s own error.
The 1e-6·‖g64‖ only keeps a tensor whose bf16 error happens to vanish from failing on fp32
noise. Documents of odd lengths, packed, one spanning several shards; each DP rank a
different subset, normalised by the step's global target count (invariant 6).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.pool import worker_mesh
from tests.helpers.bf16_rule import (_check, _docs, _flat, _fresh, _targets, criterion, excess, pooled_small,
                                      references, token_losses)

CORE = ["llama", "gpt2", "gemma2"]  # GQA + rotary; learned positions + Conv1D; windows + both softcaps
OTHERS = ["mistral", "qwen2", "qwen3", "phi3", "gpt_neox", "gpt_bigcode"]
REGIMES = ["autocast", "fsdp", "bf16"]
# (ulysses, ring, fpdt_chunks) per world size
LAYOUTS = {2: [(2, 1, 1), (1, 2, 1), (2, 1, 2)], 4: [(2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 1, 2)]}
OTHERS_LAYOUT = (4, (2, 2, 1))


def _sp_step(path: str, regime: str, mesh, memory: str | None = None) -> tuple:
    """One patched training step of this rank; loss and gradients summed over the world (float64)."""
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.distributed.gather import gather_sequence
    from hf_longctx.integrations.accelerate import fsdp_plan
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.distributed.loss import global_loss, sum_gradients

    model = patch(_fresh(path, torch.bfloat16 if regime == "bf16" else torch.float32), mesh, memory=memory)
    if regime == "fsdp":
        fsdp_plan(model, mesh, mixed_precision="bf16").apply(model)
    batch = _flat(_docs()[mesh.dp_rank :: mesh.dp])
    shard = shard_batch(batch, mesh, num_items_in_batch=_targets())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime == "autocast"):
        out = model(**shard)
    out.loss.backward()
    tokens = None if out.logits is None else token_losses(gather_sequence(out.logits, shard, mesh), batch["labels"])
    if regime == "fsdp":
        grads = {n: p.grad.full_tensor().double() for n, p in model.named_parameters()}
    else:
        sum_gradients(model.parameters(), mesh)
        grads = {n: p.grad.double() for n, p in model.named_parameters()}
    return tokens, global_loss(out.loss, mesh, dp_reduce="none"), grads


def run_cases(cases: list, refs: dict) -> dict:
    """cases: [(family, path, regime, (ulysses, ring, fpdt_chunks)[, memory preset])] -> {case: excess dict}."""
    out = {}
    for family, path, regime, (u, r, c), *memory in cases:
        mesh = worker_mesh(u, r, c)
        truth, single = refs[family][regime]
        run = _sp_step(path, regime, mesh, *memory)
        out[(family, regime, (u, r, c), *memory)] = excess(truth, single, run, mesh.dp_rank, mesh.dp)
    return out


@pytest.fixture(scope="module")
def bf16_models(tmp_path_factory):
    from tests.helpers.families import save_family

    root = tmp_path_factory.mktemp("bf16")
    paths = {f: save_family(f, root) for f in CORE + OTHERS}
    return paths, {f: references(p) for f, p in paths.items()}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("regime", REGIMES)
def test_bf16_step_core_families(pools, bf16_models, world, regime):
    paths, refs = bf16_models
    cases = [(f, paths[f], regime, layout) for layout in LAYOUTS[world] for f in CORE]
    _check(pools.get(world).run(run_cases, cases, {f: refs[f] for f in CORE}, timeout=300))


def test_bf16_step_other_families(pools, bf16_models):
    paths, refs = bf16_models
    world, layout = OTHERS_LAYOUT
    cases = [(f, paths[f], regime, layout) for regime in REGIMES for f in OTHERS]
    _check(pools.get(world).run(run_cases, cases, {f: refs[f] for f in OTHERS}, timeout=300))


def test_bf16_step_with_memory_max(pools, bf16_models):
    """memory="max" (chunked loss inside the LM head, chunked MLP, offloaded checkpointing,
    FPDT K/V offload) in every regime, Llama and Gemma2 (softcapped chunked loss) on FPDT u=2, 4 ranks
    (dp 2): no logits, so the loss is checked with its bound and every gradient as above."""
    paths, refs = bf16_models
    cases = [(f, paths[f], regime, (2, 1, 2), "max") for regime in REGIMES for f in ("llama", "gemma2")]
    _check(pools.get(4).run(run_cases, cases, {f: refs[f] for f in ("llama", "gemma2")}, timeout=300))


# ---- a few AdamW steps: FSDP2 bf16 plan (and under Accelerate) vs one process -------------
#
# Bound: per parameter, the summed update of STEPS AdamW steps satisfies the same criterion,
# ‖Δ − Δ64‖ ≤ 2·‖Δ₁ − Δ64‖ + 1e-6·‖Δ64‖, with Δ64 the float64 run and Δ₁ the one-process
# run in the same mixed precision (fp32 master weights and AdamW states, bf16 copies for
# compute, fp32 gradients; under autocast for Accelerate). Why this is "as close as bf16
# allows": the sharded run cannot be closer to Δ₁ than the bf16 noise itself (the SP/FSDP
# run rounds at other places, so its bf16 errors are different draws of the same size,
# and AdamW's normalisation m/√v turns small-gradient noise into updates of size lr in both
# runs); anything systematic (a lost or doubled gradient share, bf16 master weights, a
# bf16 reduction) makes the error exceed that noise.

STEPS, LR = 3, 1e-2


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.01)


def single_adamw(path: str, mode: str) -> dict:
    """mode "fp64": the truth; "bf16" / "bf16_autocast": fp32 master weights and AdamW,
    bf16 compute copies (under CPU autocast for the second), fp32 gradients."""
    master = _fresh(path, torch.float64 if mode == "fp64" else torch.float32)
    start = {n: p.detach().clone() for n, p in master.named_parameters()}
    opt = _adamw(master.parameters())
    for step in range(STEPS):
        work = master if mode == "fp64" else copy.deepcopy(master).to(torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16_autocast"):
            loss = work(**_flat(_docs(step)), use_cache=False).loss
        loss.backward()
        if work is not master:
            for p, w in zip(master.parameters(), work.parameters()):
                p.grad = w.grad.to(p.dtype)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: (p.detach() - start[n]).double() for n, p in master.named_parameters()}


def fsdp_adamw(path: str, refs: dict, use_accelerate: bool) -> dict:
    """STEPS AdamW steps of a patched model under fsdp_plan(mixed_precision="bf16") on this
    rank's DP share; returns per-parameter (excess, ratio) as `excess` does."""
    import contextlib

    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.accelerate import fsdp_plan
    from hf_longctx.integrations.model_patch import patch

    mesh = worker_mesh(2, 1)  # dp 2 x ulysses 2 on 4 ranks: FSDP over all 4
    accelerator = None
    if use_accelerate:
        from accelerate import Accelerator

        # No launcher env in the pool: Accelerate sees one process and gives CPU bf16
        # autocast; the FSDP plan shards (Accelerate never wraps the model).
        accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    try:
        model = patch(_fresh(path, torch.float32), mesh)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        fsdp_plan(model, mesh, mixed_precision="bf16").apply(model)
        opt = _adamw(model.parameters())
        for step in range(STEPS):
            batch = _flat(_docs(step)[mesh.dp_rank :: mesh.dp])
            shard = shard_batch(batch, mesh, num_items_in_batch=_targets())
            with accelerator.autocast() if accelerator else contextlib.nullcontext():
                loss = model(**shard).loss
            accelerator.backward(loss) if accelerator else loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        updates = {n: p.full_tensor().detach().double() - start[n].double() for n, p in model.named_parameters()}
    finally:
        if accelerator is not None:
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state(reset_partial_state=True)  # the pool's next task starts clean
    truth, single = refs["fp64"], refs["bf16_autocast" if use_accelerate else "bf16"]
    out = {}
    for n, t, s, u in pooled_small([(n, truth[n], single[n], updates[n]) for n in truth]):
        out[n] = criterion(t, s, u)
    return out


@pytest.mark.parametrize("use_accelerate", [False, True], ids=["fsdp_bf16", "accelerate_bf16"])
def test_fsdp_bf16_adamw_steps_track_single_process(pools, bf16_models, use_accelerate):
    paths, _ = bf16_models
    refs = {m: single_adamw(paths["llama"], m) for m in ("fp64", "bf16_autocast" if use_accelerate else "bf16")}
    results = pools.get(4).run(fsdp_adamw, paths["llama"], refs, use_accelerate, timeout=300)
    _check([{("llama", "adamw", use_accelerate): r} for r in results])
