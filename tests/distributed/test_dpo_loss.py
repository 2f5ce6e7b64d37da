"""DPO on a sharded packed row of pairs (training/dpo/loss.py) vs a single-process DPO.

Reference: the unpatched tiny Llama run on EACH document alone (no packing, no SP), TRL's
formulas by hand (sigmoid -logsigmoid(beta·delta), hinge relu(1 - beta·delta), ipo on
length-normalised scores), mean over the GLOBAL pairs (all DP ranks); precomputed reference
log-probs (fixed numbers, TRL's precompute_ref_log_probs path). Meshes U2×R2 and dp2×U2 on 4
gloo ranks. fp32: loss and metrics 1e-5, gradients 1e-4 relative (tests/distributed/test_models.py).
bf16 (weights loaded in bf16, U2×R2): tests/helpers/bf16_rule.py per gradient tensor (small
ones pooled), ‖g − g64‖ ≤ 2·‖g₁ − g64‖ + 1e-6·‖g64‖, and for the loss (a scalar) the
single-process error plus one bf16 rounding, with g64 the single-process DPO in float64 on the
same bf16-rounded weights and g₁ the single-process DPO in bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers.pool import worker_mesh

PROMPT, BETA = 3, 0.5


def _pairs(seed: int):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(2):  # two pairs per DP rank; chosen and rejected share the prompt
        prompt = torch.randint(1, 128, (PROMPT,), generator=g)
        for n in torch.randint(4, 14, (2,), generator=g).tolist():
            docs.append(torch.cat([prompt, torch.randint(1, 128, (n,), generator=g)]))
    return docs


def _row(docs):
    ids = torch.cat(docs)[None]
    labels = ids.clone()
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    start = 0
    for d in docs:
        labels[0, start : start + PROMPT] = -100
        start += len(d)
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def _ref_logps(count: int, seed: int) -> torch.Tensor:
    return -20 - 10 * torch.rand(count, generator=torch.Generator().manual_seed(seed))


def _single_process(path, all_docs, dtype, loss_type, global_pairs):
    """DPO of every pair, each document alone through the unpatched model: (loss, grads)."""
    from transformers import AutoModelForCausalLM

    from hf_longctx.training.dpo.loss import dpo_loss

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if dtype != torch.float32 else dtype)
    ref = ref.to(dtype).train()  # float64: the bf16-rounded weights, exactly
    logps, counts = [], []
    for docs in all_docs:
        for d in docs:
            logits = ref(input_ids=d[None], use_cache=False).logits[0, :-1]  # [n-1, V]
            lp = torch.log_softmax(logits.to(torch.float64 if dtype == torch.float64 else torch.float32), -1)
            lp = lp.gather(-1, d[1:, None])[:, 0][PROMPT - 1 :]
            logps.append(lp.sum())
            counts.append(float(lp.numel()))
    policy = torch.stack(logps)
    loss, metrics = dpo_loss(policy, _ref_logps(len(logps), 5).to(policy.dtype), beta=BETA, loss_type=loss_type,
                             global_pairs=global_pairs, sp=1, counts=torch.tensor(counts))
    loss.backward()
    return loss.detach().double(), {n: p.grad.double() for n, p in ref.named_parameters() if p.grad is not None}


def _run_bf16(ulysses, ring, path, loss_type):
    from transformers import AutoModelForCausalLM

    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.distributed.loss import global_loss, sum_gradients
    from hf_longctx.training.dpo.loss import completion_logps, dpo_loss

    mesh = worker_mesh(ulysses, ring)
    all_docs = [_pairs(100 + d) for d in range(mesh.dp)]
    global_pairs = sum(len(d) // 2 for d in all_docs)
    l64, g64 = _single_process(path, all_docs, torch.float64, loss_type, global_pairs)
    l1, g1 = _single_process(path, all_docs, torch.bfloat16, loss_type, global_pairs)
    model = patch(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).train(), mesh)
    shard = shard_batch(_row(all_docs[mesh.dp_rank]), mesh)
    shard.pop("labels"), shard.pop("num_items_in_batch")
    sums, cnt = completion_logps(model(**shard).logits, shard, mesh)
    mine = slice(4 * mesh.dp_rank, 4 * mesh.dp_rank + 4)
    loss, _ = dpo_loss(sums, _ref_logps(4 * mesh.dp, 5)[mine], beta=BETA, loss_type=loss_type,
                       global_pairs=global_pairs, sp=mesh.sp, counts=cnt)
    loss.backward()
    sum_gradients(model.parameters(), mesh)
    total = global_loss(loss, mesh)
    bad = []
    from tests.helpers.bf16_rule import criterion, pooled_small, scalar_excess

    over, ratio = scalar_excess(total.item(), l1.item(), l64.item())  # one scalar: bf16_rule's scalar allowance
    if over > 0:
        bad.append(f"loss: {total.item()} vs truth {l64.item()} (single bf16 {l1.item()}), {ratio:.2f} of the allowance")
    rows = pooled_small([(n, g64[n], g1[n], p.grad.double()) for n, p in model.named_parameters() if n in g64])
    bad += [f"{name}: {criterion(t, s, r)[1]:.2f}x the single-process error" for name, t, s, r in rows if criterion(t, s, r)[0] > 0]
    return bad


def test_bf16_no_worse_than_twice_single_process(pools, llama_path):
    for rank, bad in enumerate(pools.get(4).run(_run_bf16, 2, 2, llama_path, "sigmoid", timeout=300)):
        assert not bad, f"rank {rank}: " + "; ".join(bad)


def _run(ulysses, ring, path, loss_type):
    from transformers import AutoModelForCausalLM

    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch
    from hf_longctx.distributed.loss import global_loss, sum_gradients
    from hf_longctx.training.dpo.loss import completion_logps, dpo_loss

    mesh = worker_mesh(ulysses, ring)
    all_docs = [_pairs(100 + d) for d in range(mesh.dp)]  # every DP rank's pairs (for the reference)
    global_pairs = sum(len(d) // 2 for d in all_docs)
    # reference: each document alone, unpatched
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    logps, counts = [], []
    for docs in all_docs:
        for d in docs:
            logits = ref(input_ids=d[None], use_cache=False).logits[0, :-1].float()  # [n-1, V]
            t = d[1:]
            lp = torch.log_softmax(logits, -1).gather(-1, t[:, None])[:, 0][PROMPT - 1 :]
            logps.append(lp.sum())
            counts.append(float(lp.numel()))
    ref_sums = _ref_logps(len(logps), 5)
    r_loss, r_metrics = dpo_loss(torch.stack(logps), ref_sums, beta=BETA, loss_type=loss_type, global_pairs=global_pairs, sp=1, counts=torch.tensor(counts))
    r_loss.backward()
    r_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    # SP: this DP rank's pairs, packed and sharded
    model = patch(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train(), mesh)
    shard = shard_batch(_row(all_docs[mesh.dp_rank]), mesh)
    shard.pop("labels"), shard.pop("num_items_in_batch")
    sums, cnt = completion_logps(model(**shard).logits, shard, mesh)
    mine = slice(4 * mesh.dp_rank, 4 * mesh.dp_rank + 4)
    loss, metrics = dpo_loss(sums, ref_sums[mine], beta=BETA, loss_type=loss_type, global_pairs=global_pairs, sp=mesh.sp, counts=cnt)
    loss.backward()
    sum_gradients(model.parameters(), mesh)
    total = global_loss(loss, mesh)
    for v in metrics.values():
        if mesh.dp > 1:
            dist.all_reduce(v, group=mesh.dp_group)  # sums over this SP group's pairs -> all pairs
    out = {"loss": abs(total.item() - r_loss.item()) / abs(r_loss.item())}
    out["metrics"] = max(abs(metrics[k].item() - r_metrics[k].item()) / global_pairs for k in metrics)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    out["missing"] = set(grads) ^ set(r_grads)
    out["grad"] = max(((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() for n, g in r_grads.items())
    return out


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    path = str(tmp_path_factory.mktemp("dpo") / "llama")
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("ulysses,ring,loss_type", [(2, 2, "sigmoid"), (2, 1, "sigmoid"), (2, 2, "ipo"), (2, 1, "hinge")])
def test_dpo_matches_single_process(pools, llama_path, ulysses, ring, loss_type):
    for rank, out in enumerate(pools.get(4).run(_run, ulysses, ring, llama_path, loss_type, timeout=300)):
        assert not out["missing"], f"rank {rank}: gradient sets differ {out['missing']}"
        assert out["loss"] <= 1e-5, f"rank {rank}: {out}"
        assert out["metrics"] <= 1e-5, f"rank {rank}: {out}"
        assert out["grad"] <= 1e-4, f"rank {rank}: {out}"
