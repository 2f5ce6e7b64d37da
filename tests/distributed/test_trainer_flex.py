"""`LongContextTrainer` with a group bank (flexible SP groups) on 4 gloo ranks equals the same
trainer in one process (fp32).

The bank holds groups of sizes 1, 2 and 4 (4 query heads, ranks_per_node 2: size 4 is
Ulysses 2 × ring 2, size 2 Ulysses 2, size 1 local attention), FSDP2 shards the tiny Llama
over all 4 ranks, and each step's global documents (3..39 tokens) are planned with
`plan_flexible` under max_tokens_per_rank 12: a document above 24 tokens needs the group of
4, one above 12 a group of at least 2, the rest fit a single rank -- so the planner mixes
layouts within a step. The reference is the single-process run of the same trainer with the
plain mesh of one rank, on the same steps (the step sampler does not depend on the mesh).
The logged loss and grad_norm of every one of the 3 AdamW steps (cosine schedule, warm-up,
clipping at 1.0) and the eval loss must agree within 1e-5 relative: fp32, where summation
order changes results by ~1e-7, while a lost or duplicated document, a wrong group or a
wrong normaliser is off by >= 1e-2 (see test_trainer.py). The test also asserts that at
least one step's slots use different layouts, so the equality covers a mixed step. The same
holds with `unequal_calls=True` (steps planned by `plan_unequal`, the model unsharded for the
step), where at least one step must give ranks different micro-batch counts.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.families import save_family
from tests.helpers.pool import worker_bank
from tests.helpers.trainer_cases import assert_steps_close, history, make_dataset, training_args

TOL = 1e-5
PER_RANK = 12


def _trainer(path: str, output_dir: str, bank=None, unequal_calls: bool = False):
    from transformers import AutoModelForCausalLM

    from hf_longctx import LongContextTrainer, init_sequence_parallel, patch

    args = training_args(output_dir)  # first: it adopts the process group
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    common = dict(args=args, train_dataset=make_dataset(masked=True), eval_dataset=make_dataset(8, seed=1),
                  tokens_per_step=120)
    if bank is None:
        mesh = init_sequence_parallel()
        return LongContextTrainer(model=patch(model, mesh), mesh=mesh, max_tokens=4 * PER_RANK, **common)
    return LongContextTrainer(model=patch(model, bank), mesh=bank, max_tokens_per_rank=PER_RANK,
                              unequal_calls=unequal_calls, **common)


def _run(path: str, output_dir: str, flex: bool, unequal_calls: bool = False) -> dict:
    import torch.distributed as dist

    bank = worker_bank(heads=4, ranks_per_node=2) if flex else None
    trainer = _trainer(path, output_dir, bank, unequal_calls)
    calls = []  # this rank's micro-batches in every training step
    step = trainer.training_step

    def counting(model, inputs, *args, **kwargs):
        calls.append(len(inputs.micro_batches))
        return step(model, inputs, *args, **kwargs)

    trainer.training_step = counting
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    return {
        "steps": history(trainer), "eval": trainer.evaluate()["eval_loss"],
        "layouts": [h.get("plan_layouts") for h in logs], "busy": [h.get("plan_busy_max_over_mean") for h in logs],
        "splits": [(s.size, s.ulysses, s.ring) for s in bank.shapes] if bank else None,
        "calls": calls, "rank": dist.get_rank() if dist.is_initialized() else 0,
    }


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_family("llama", tmp_path_factory.mktemp("trainer_flex"))


def test_flex_trainer_matches_single_process(pools, llama, tmp_path):
    ref = _run(llama, str(tmp_path / "ref"), flex=False)
    out = pools.get(4).run(_run, llama, str(tmp_path / "flex"), True, timeout=600)
    for rank, res in enumerate(out):
        assert res["splits"] == [(1, 1, 1), (2, 2, 1), (4, 2, 2)], f"rank {rank}: bank {res['splits']}"
        assert_steps_close(res["steps"], ref["steps"], TOL, f"flex rank {rank}")
        assert res["eval"] == pytest.approx(ref["eval"], rel=TOL), f"rank {rank}: eval loss {res['eval']} vs {ref['eval']}"
        assert res["layouts"] == out[0]["layouts"], f"rank {rank} logged other layouts"
    layouts = out[0]["layouts"]
    assert all(isinstance(x, str) and x for x in layouts), layouts
    mixed = [x for x in layouts if len(set(x.split())) > 1]  # a step whose slots differ in layout
    assert mixed, f"no step mixed slot layouts: {layouts}"
    sizes = {int(s) for x in layouts for slot in x.split() for s in slot.strip("[]").split("+")}
    assert sizes == {1, 2, 4}, f"groups of every size should train (local attention included): {layouts}"
    assert all(b is not None and b >= 1.0 for b in out[0]["busy"]), out[0]["busy"]


def test_unequal_calls_trainer_matches_single_process(pools, llama, tmp_path):
    """`unequal_calls=True`: every step is planned with `plan_unequal` and FSDP2 runs it
    unsharded; ranks run different numbers of micro-batches in at least one step, and the
    logged losses, grad norms and eval loss still equal the single-process trainer's."""
    ref = _run(llama, str(tmp_path / "ref"), flex=False)
    out = pools.get(4).run(_run, llama, str(tmp_path / "unequal"), True, True, timeout=600)
    for rank, res in enumerate(out):
        assert_steps_close(res["steps"], ref["steps"], TOL, f"unequal rank {rank}")
        assert res["eval"] == pytest.approx(ref["eval"], rel=TOL), f"rank {rank}: eval loss {res['eval']} vs {ref['eval']}"
    per_step = list(zip(*(res["calls"] for res in out)))  # [(rank 0's count, rank 1's, ...) per step]
    assert per_step and any(len(set(c)) > 1 for c in per_step), f"no step with unequal counts: {per_step}"


def test_bank_settings_are_refused_before_training(llama, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_longctx import LongContextTrainer, init_group_bank, init_sequence_parallel, patch

    bank, mesh = init_group_bank(heads=4), init_sequence_parallel()
    ds = make_dataset(4)

    def build(model, **kw):
        return LongContextTrainer(model=model, args=training_args(str(tmp_path)), train_dataset=ds, tokens_per_step=120, **kw)

    model = patch(AutoModelForCausalLM.from_pretrained(llama), bank)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        build(model, mesh=bank, max_tokens=48)
    with pytest.raises(ValueError, match="plan_flexible"):
        build(model, mesh=bank, max_tokens_per_rank=48, strategy="ffd")
    with pytest.raises(ValueError, match="different mesh"):
        build(model, mesh=mesh, max_tokens=48)
    plain = patch(AutoModelForCausalLM.from_pretrained(llama), mesh)
    with pytest.raises(ValueError, match="GroupBank"):
        build(plain, mesh=bank, max_tokens_per_rank=48)
    with pytest.raises(ValueError, match="exceed"):  # 39-token documents, one rank of 8 tokens
        build(model, mesh=bank, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="unequal_calls=True needs a GroupBank"):
        build(plain, mesh=mesh, max_tokens=48, unequal_calls=True)
    with pytest.raises(ValueError, match="sync_each_microbatch=True cannot be combined with unequal_calls=True"):
        build(model, mesh=bank, max_tokens_per_rank=48, unequal_calls=True, sync_each_microbatch=True)
