"""One step on flexible SP groups (a pool task) and its single-process reference and checks.

`_flex_step(path, ranks_per_node, fpdt_chunks, fsdp, checkpoint, equal_calls, ...)` patches a
saved model with a `GroupBank`, runs `run_flex_step` over the slots of SLOTS (four layouts
changing from slot to slot, one group empty) or SLOTS_UNEQUAL (ranks run 5, 3, 4, 4
micro-batches) on the documents of LENGTHS, and returns the loss and per-parameter gradient
errors against `_reference` (the unpatched model in one process on one packed row of all
the step's documents), with the bank's splits, call counts, reshard state, reduce-scatter
count and the dtypes the linear layers computed in. `check_results` asserts them at
LOSS_TOL / GRAD_TOL (fp32, as tests/distributed/test_models.py). Used by
tests/distributed/test_flex.py and the 4-GPU test of tests/gpu/test_multi_gpu.py.
"""

from __future__ import annotations

import torch

from tests.helpers.families import load, rel
from tests.helpers.pool import worker_bank

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
LENGTHS = [23, 9, 17, 6, 11, 5, 14, 7, 3, 19, 8, 4]
# slot -> groups (size, index, documents): four layouts, one group empty.
SLOTS = [
    [(4, 0, (0, 1))],
    [(2, 0, (2,)), (2, 1, (3, 4))],
    [(2, 0, (5, 6)), (1, 2, (7,)), (1, 3, ())],
    [(1, 0, (8,)), (1, 1, (9,)), (1, 2, (10,)), (1, 3, (11,))],
]

# Unequal calls (plan_unequal's mode): ranks run 5, 3, 4, 4 micro-batches; rank 1 idles in
# slot 2, ranks 2-3 open a size-2 group while rank 0 runs alone; every rank's last
# micro-batch closes its group (FlexPlan's rule).
SLOTS_UNEQUAL = [
    [(4, 0, (0, 1))],
    [(2, 0, (2,)), (1, 2, (3,)), (1, 3, (4,))],
    [(1, 0, (5,)), (1, 2, (6,)), (1, 3, ())],
    [(1, 0, (7,)), (2, 1, (8, 9))],
    [(1, 0, (10,)), (1, 1, (11,))],
]


def _documents(seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (n,), generator=g).tolist() for n in LENGTHS]


def _plan(bank, equal_calls: bool = True):
    from hf_longctx.flex.plan import FlexGroup, FlexPlan

    slots = tuple(tuple(FlexGroup(s, i, d) for s, i, d in slot) for slot in (SLOTS if equal_calls else SLOTS_UNEQUAL))
    return FlexPlan(slots=slots, lengths=tuple(LENGTHS), world_size=4, max_tokens_per_rank=32, shapes=bank.shapes,
                    equal_calls=equal_calls)


def _reference(path: str):
    from transformers import DataCollatorWithFlattening

    model = load(path)
    batch = DataCollatorWithFlattening(return_position_ids=True, return_tensors="pt")([{"input_ids": d} for d in _documents()])
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _flex_step(path: str, ranks_per_node: int, fpdt_chunks: int, fsdp: bool, checkpoint: bool, equal_calls: bool,
               sync_each_microbatch: bool = False, mixed_precision: str | None = "fp32") -> dict:
    from hf_longctx.flex.step import run_flex_step
    from hf_longctx.integrations.accelerate import fsdp_plan
    from hf_longctx.integrations.model_patch import patch

    ref_loss, ref_grads = _reference(path)
    bank = worker_bank(heads=4, ranks_per_node=ranks_per_node, fpdt_chunks=fpdt_chunks)
    model = patch(load(path), bank, checkpoint=checkpoint)
    if fsdp:  # mixed_precision None: the plan follows the model's dtype (fp32 here)
        fsdp_plan(model, bank.world, **({} if mixed_precision is None else {"mixed_precision": mixed_precision})).apply(model)
    dtypes = set()  # what the linear layers compute in
    hooks = [m.register_forward_pre_hook(lambda mod, a: dtypes.add(str(a[0].dtype))) for m in model.modules()
             if isinstance(m, torch.nn.Linear)]
    plan = _plan(bank, equal_calls)
    units = sum(1 for m in model.modules() if hasattr(m, "set_requires_gradient_sync"))
    scatters = []  # FSDP2's gradient reduce-scatters of this rank during the step
    # what torch's FSDP2 calls (_fsdp_collectives.py): reduce_scatter_single on torch 2.13, reduce_scatter_tensor on 2.11
    name = "reduce_scatter_single" if hasattr(torch.distributed, "reduce_scatter_single") else "reduce_scatter_tensor"
    scatter = getattr(torch.distributed, name)

    def counted(*args, **kwargs):
        scatters.append(1)
        return scatter(*args, **kwargs)

    setattr(torch.distributed, name, counted)
    try:
        loss = run_flex_step(model, bank, plan, _documents(), sync_each_microbatch=sync_each_microbatch)
    finally:
        setattr(torch.distributed, name, scatter)
        for h in hooks:
            h.remove()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad
        grads[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).cpu()  # the reference is on the host
    errs = {n: rel(grads[n], ref_grads[n]) for n in ref_grads}
    splits = [(s.size, s.ulysses, s.ring, s.fpdt_chunks) for s in bank.shapes]
    resharded = all(not hasattr(p, "full_tensor") or p.to_local().numel() < p.numel() or p.numel() == 1
                    for p in model.parameters())  # FSDP2 parameters are sharded again after the step
    return {"loss_err": abs(float(loss) - ref_loss) / abs(ref_loss), "errs": errs, "splits": splits,
            "calls": len(plan.for_rank(bank.rank)), "resharded": resharded, "scatters": len(scatters), "units": units,
            "dtypes": sorted(dtypes)}


def check_results(results: list[dict], splits: list, equal_calls: bool) -> None:
    """Per-rank call counts, reshard, the bank's splits, loss and gradients (also the 4-GPU test's)."""
    calls = [res["calls"] for res in results]
    assert calls == ([4] * 4 if equal_calls else [5, 3, 4, 4]), f"micro-batches per rank {calls}"
    for rank, res in enumerate(results):
        assert res["resharded"], f"rank {rank}: parameters left unsharded after the step"
        assert res["splits"] == splits, f"rank {rank}: bank (size, U, R, fpdt) = {res['splits']}"
        assert res["loss_err"] <= LOSS_TOL, f"rank {rank}: loss rel err {res['loss_err']:.2e}"
        worst = max(res["errs"], key=res["errs"].get)
        assert res["errs"][worst] <= GRAD_TOL, f"rank {rank}: {worst} grad rel err {res['errs'][worst]:.2e}"
