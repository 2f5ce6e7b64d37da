"""recipes/dpo.py (on `LongDPOTrainer`) runs as documented under `accelerate launch` on 2 CPU
ranks (gloo, Ulysses 2, FSDP2): the tiny Llama the recipe builds and saves, its locally made
text pairs (tokenized by TRL), TRL's default reference. Both steps finish; every logged value
is finite and the SAME on both ranks (global values); step 1 logs loss ln 2 and zero rewards
(policy == reference; with --precompute-ref-log-probs the reference's log-probs are stored before
training), step 2 non-zero rewards (the update reached the policy, not the
reference); rank 0 prints per-step lines with TRL's metric names. The run is under `--memory max`
(the policy and the reference patched with it, as the printed patch line reads back from the
trained model). Also: the DPO guide's building-block loop runs as written."""

from __future__ import annotations

import math

import pytest

from tests.helpers.recipe_launch import assert_ranks_agree, launch, rank_logs

TIMING = {"tokens_per_s", "peak_mem_gib"}  # wall-clock and per-rank memory: may differ between ranks


@pytest.mark.parametrize("precompute", [False, True], ids=["held-reference", "precomputed-reference"])
def test_dpo_recipe_runs(tmp_path, precompute):
    """--precompute-ref-log-probs: the initial policy scores every pair before step 1, so step 1's
    loss is ln 2 only if the stored columns are the reference's log-probs of those pairs."""
    proc = launch("dpo.py", "--ulysses", "2", "--steps", "2", "--pairs", "16", "--memory", "max",
                  "--output-dir", str(tmp_path), *(["--precompute-ref-log-probs"] if precompute else []))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    logs = rank_logs(tmp_path)
    assert_ranks_agree(logs, [1, 2], TIMING)
    first, second = logs[0]
    assert abs(first["loss"] - math.log(2)) < 1e-5 and first["rewards/margins"] == 0.0, first  # policy == reference
    assert first["grad_norm"] > 0 and second["rewards/chosen"] != 0.0 and second["rewards/margins"] != 0.0, second
    assert "patched: memory='max', checkpoint=True" in proc.stdout, out[-2000:]
    for name in ("step 1: loss=", "step 2: loss=", "grad_norm=", "rewards/margins=", "rewards/accuracies="):
        assert name in proc.stdout, (name, out[-2000:])


def test_dpo_guide_building_block_loop():
    """The DPO guide's building-block loop (docs/guides/dpo.md, "The same blocks in a loop of your
    own") runs as written on a one-process mesh: with the reference a copy of the policy the loss is ln 2 (the
    per-pair sigmoid loss at zero margin, summed over micro-batches), and the step changes the policy."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_longctx import init_sequence_parallel, patch
    from tests.helpers.doc_blocks import blocks_run_by

    (block,) = blocks_run_by("docs/guides/dpo.md", "tests/integration/test_dpo_recipe.py::test_dpo_guide_building_block_loop")
    block = block.text
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    base = LlamaForCausalLM(cfg).float()
    mesh = init_sequence_parallel()
    model, ref = patch(base, mesh), patch(copy.deepcopy(base).eval().requires_grad_(False), mesh)
    before = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(1, 64, (n,), generator=g).tolist()  # noqa: E731
    batch = [{"prompt": ids(4), "chosen": ids(7), "rejected": ids(5)} for _ in range(3)]
    scope = {"torch": torch, "model": model, "ref": ref, "mesh": mesh, "batch": batch,
             "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    losses = []
    exec(compile(block.replace("loss.backward()",  # record each micro-batch's loss share
                               "loss.backward(); _losses.append(loss.item())"), "docs/guides/dpo.md", "exec"),
         {**scope, "_losses": losses})
    assert losses and abs(sum(losses) - math.log(2)) < 1e-5, losses
    assert any((p.detach() - b).abs().max() > 0 for p, b in zip(model.parameters(), before)), "no update"
