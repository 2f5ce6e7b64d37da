"""Pool tasks of the sequence-parallel generation tests: `sp_generate` on a patched (optionally
FSDP2-sharded) model against transformers' `generate` of the unpatched model, on this rank.

`save_generation_family` saves the tiny models the tests decode with: the families of
tests/helpers/families.py (GQA llama, qwen2 with one sliding layer, gemma2 with softcaps and a
window) and a GPT-OSS with attention sinks of order 1. `greedy_case` decodes this DP group's
prompts greedily with a stop token that ends some rows early (chosen from the reference's own
greedy output, so rows end at different steps), counts the model's forwards, and returns the
completions beside `generate`'s, one prompt at a time. `sampled_case` samples with every
supported option on: with one owner (SP rank 0 samples all rows, seeded alike on every rank) the
reference is `generate` on all rows as one left-padded batch; with owners per SP rank (rank r
seeded by r) it is `generate` on rank r's rows.
"""

from __future__ import annotations

import torch

from tests.helpers.families import family_config, load
from tests.helpers.pool import worker_mesh
from tests.helpers.sink_models import save_with_visible_sinks

PROMPTS = [[5, 17, 42, 9, 11, 3, 60], [8, 8, 31], [60, 2, 77, 14, 90, 21, 4, 4, 19, 33, 7], [12]]
PROMPTS_DP1 = [[9, 9, 100, 44, 2], [71, 70, 69, 68, 67, 66, 65, 64, 63], [14, 15]]
STOPS = list(range(5, 128, 5))  # a fifth of the vocabulary stops a row: sampled rows end at different steps
SAMPLING = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3)


def save_generation_family(family: str, root) -> str:
    import transformers as tf

    torch.manual_seed(0)
    if family == "gpt_oss":
        cfg = tf.GptOssConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, sliding_window=8, head_dim=8,
                              layer_types=["sliding_attention", "full_attention"], num_local_experts=2,
                              num_experts_per_tok=2, output_router_logits=False)
    else:
        cfg = family_config(family)
    return save_with_visible_sinks(tf.AutoModelForCausalLM.from_config(cfg), f"{root}/{family}")


def hf_rows(model, prompts, max_new: int, eos, **sampling) -> list[list[int]]:
    """transformers' generate on `prompts` as one left-padded batch, cut after the first stop token."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0, **sampling)
    stops = set([eos] if isinstance(eos, int) else eos)
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stops), None)
        rows.append(row[: cut + 1] if cut is not None else row)
    return rows


def _patched(path, mesh, fsdp: bool, memory: str | None):
    from hf_longctx.integrations.accelerate import fsdp_plan
    from hf_longctx.integrations.model_patch import patch

    model = patch(load(path), mesh, **({"memory": memory} if memory else {}))
    if fsdp:
        fsdp_plan(model, mesh, mixed_precision="fp32").apply(model)
    return model


def greedy_case(path: str, ulysses: int, ring: int, fpdt: int, *, fsdp: bool = False, weights: str = "auto",
                memory: str | None = None, max_new: int = 12, cache: str = "device") -> dict:
    from hf_longctx.generation.loop import sp_generate

    mesh = worker_mesh(ulysses, ring, fpdt)
    prompts = PROMPTS if mesh.dp_rank == 0 else PROMPTS_DP1
    ref = load(path).eval()
    free = [hf_rows(ref, [p], max_new, eos=1000)[0] for p in prompts]  # greedy; 1000 is no token: no stop
    eos = free[0][3]  # the 4th token of row 0: row 0 stops there, others wherever it occurs, or never
    want = [hf_rows(ref, [p], max_new, eos=eos)[0] for p in prompts]
    model = _patched(path, mesh, fsdp, memory)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *a: forwards.append(1))
    got = sp_generate(model, prompts, mesh, max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                      pad_token_id=0, weights=weights, cache=cache, log=None)
    hook.remove()
    return {"got": got, "want": want, "forwards": len(forwards), "lengths": [len(c) for c in got]}


def sampled_case(path: str, ulysses: int, ring: int, *, per_rank_owners: bool, max_new: int = 10) -> dict:
    from hf_longctx.generation.loop import sp_generate

    mesh = worker_mesh(ulysses, ring)
    prompts = PROMPTS + PROMPTS_DP1
    owners = [n % mesh.sp for n in range(len(prompts))] if per_rank_owners else [0] * len(prompts)
    seed = 1234 + (mesh.sp_rank if per_rank_owners else 0)
    mine = [p for p, o in zip(prompts, owners) if o == mesh.sp_rank]
    ref = load(path).eval()
    torch.manual_seed(seed)
    want = hf_rows(ref, mine, max_new, eos=STOPS, **SAMPLING) if mine else []
    after_ref = torch.rand(1).item()  # the RNG state generate leaves behind
    model = _patched(path, mesh, fsdp=False, memory=None)
    torch.manual_seed(seed)
    got = sp_generate(model, prompts, mesh, owners=owners, max_new_tokens=max_new, eos_token_id=STOPS, pad_token_id=0,
                      log=None, **SAMPLING)
    after = torch.rand(1).item()
    return {"got": got, "mine": [c for c, o in zip(got, owners) if o == mesh.sp_rank], "want": want,
            "rng_after": (after, after_ref)}


def refusal_case(path: str) -> dict:
    """Every bad input raises on every rank before generation (the pool would time out on a hang)."""
    from hf_longctx.generation.loop import sp_generate

    mesh = worker_mesh(2, 1)
    model = _patched(path, mesh, fsdp=False, memory=None)
    base = dict(max_new_tokens=4, eos_token_id=3, pad_token_id=0, log=None)
    calls = {
        "beams": lambda: sp_generate(model, PROMPTS, mesh, num_beams=2, **base),
        "ngram": lambda: sp_generate(model, PROMPTS, mesh, no_repeat_ngram_size=2, **base),
        "over_plan": lambda: sp_generate(model, PROMPTS, mesh, max_tokens=30, **base),
        "bad_id": lambda: sp_generate(model, [[5, 500]], mesh, **base),
        "per_rank_prompts": lambda: sp_generate(model, PROMPTS[mesh.sp_rank:], mesh, **base),
        "unpatched": lambda: sp_generate(load(path), PROMPTS, mesh, **base),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except ValueError as e:  # NotSupported is a ValueError
            out[name] = f"{type(e).__name__}: {e}"
    out["after"] = sp_generate(model, PROMPTS[:1], mesh, **base)  # the group still decodes together
    return out
