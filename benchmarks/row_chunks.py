"""What the row-chunked paths run per step as the row chunks grow: parameter-gradient traffic, projection GEMMs.

Where it sits: a measurement of `ops/grad_sums.py` inside the chunked paths of `patch()` --
memory="max"'s row-chunked layers (`integrations/layer_run.py`), the chunked MLP and norms
(`ops/tiling._Tokenwise`) and the chunked LM head + loss (`ops/chunked_loss.py`). A
TorchDispatchMode (`GradTraffic`) watches one fwd+bwd step and counts, for the model's
matrix parameters (2-D: projections, LM head, embeddings), every FRESH tensor of a parameter's
shape (an op output that is not a view and not written in place: a full-size gradient, or the
sum's one buffer) and every separate ADD kernel on such tensors (`add`/`add_` with a
parameter-shaped operand), with their bytes. Vector parameters (norm weights, biases: O(hidden)
per chunk) are counted apart. Nothing is timed.

Rows: a tiny Llama (hidden 32, 2 and 4 decoder layers, vocab 56, 90 tokens, one process),
memory="max" knobs (checkpoint=True, mlp_chunks=u, loss_chunks=u) and memory="balanced" knobs
(mlp_chunks=u, loss_chunks=u) at u = 2 and 8 row chunks. Per layer = (4-layer - 2-layer) / 2,
per step = the 2-layer step.

Projection GEMMs (`projection_gemms`): under memory="max" knobs, per step, the forward GEMMs
of decoder layer 0's q_proj (aten GEMMs that read its weight and write its output features,
seen by a TorchDispatchMode) and the calls of the q_proj module (forward pre-hook), one
process, after a warm-up step; the backward's GEMMs (input and weight gradients) are other
ops and not counted. Per row chunk the layer runs pre (forward), post (forward), and in the
backward pre (recompute of q, k, v), post and pre with gradients: post's projections feed only
the replayed attention, so they return placeholders (`LayerSplit.before_attention`).

    PYTHONPATH=. python benchmarks/row_chunks.py
"""

from __future__ import annotations

import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOKENS = 90  # no activation row count equals a weight dimension of the model below
MODES = {"max": dict(checkpoint=True), "balanced": {}}


class GradTraffic(TorchDispatchMode):
    """Fresh parameter-shaped tensors and add kernels on them, with bytes (see module docstring)."""

    def __init__(self, params) -> None:
        super().__init__()
        self.matrix = {tuple(p.shape) for p in params if p.dim() == 2}
        self.vector = {tuple(p.shape) for p in params if p.dim() == 1}
        self.counts = dict.fromkeys(("fresh", "fresh_bytes", "adds", "add_bytes", "vector_fresh", "vector_adds"), 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        fresh = [] if func.is_view or func._schema.is_mutable else outs
        c = self.counts
        for t in fresh:
            if tuple(t.shape) in self.matrix:
                c["fresh"] += 1
                c["fresh_bytes"] += t.numel() * t.element_size()
            elif tuple(t.shape) in self.vector:
                c["vector_fresh"] += 1
        if name in ("add", "add_"):
            shaped = [t for t in ins if tuple(t.shape) in self.matrix]
            if shaped:
                c["adds"] += 1
                c["add_bytes"] += sum(t.numel() * t.element_size() for t in shaped + outs[:1])
            elif any(tuple(t.shape) in self.vector for t in ins):
                c["vector_adds"] += 1
        return out


def tiny_llama(layers: int):
    import transformers as tf

    torch.manual_seed(0)
    # weights [40|20|48|56, 32] and [32, 40|48]: no chunk of 45, 11 or 12 rows has one of their shapes
    return tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=10,
                                              vocab_size=56, max_position_embeddings=128))


def step_traffic(mode: str, chunks: int, layers: int) -> dict:
    """One fwd+bwd step of the patched tiny Llama on one process (after a warm-up step)."""
    from hf_longctx import init_sequence_parallel
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch, unpatch

    model = tiny_llama(layers)
    mesh = init_sequence_parallel(1, 1)
    patch(model, mesh, mlp_chunks=chunks, loss_chunks=chunks, **MODES[mode])
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 56, (1, TOKENS), generator=g)
    shard = shard_batch({"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(TOKENS)[None]}, mesh)
    model(**shard).loss.backward()
    model.zero_grad(set_to_none=True)
    with GradTraffic(list(model.parameters())) as traffic:
        model(**shard).loss.backward()
    unpatch(model)
    return traffic.counts


class ForwardGemms(TorchDispatchMode):
    """GEMMs that read `weight` (or a view of it) and write its output features: the forward
    GEMMs of the projection (the input-gradient GEMM writes the input features instead)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.ptr, self.out_features, self.n = weight.untyped_storage().data_ptr(), weight.shape[0], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name.split("::")[-1] in ("mm", "addmm", "bmm", "baddbmm", "linear") and any(
                isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.ptr for t in args) \
                and out.shape[-1] == self.out_features:
            self.n += 1
        return out


def projection_gemms(chunks: int) -> tuple[int, int]:
    """(q_proj forward GEMMs, q_proj module calls) of decoder layer 0 in one step of memory="max"
    knobs with `chunks` row chunks (one process, after a warm-up step)."""
    from hf_longctx import init_sequence_parallel
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch, unpatch

    model = tiny_llama(2)
    mesh = init_sequence_parallel(1, 1)
    patch(model, mesh, checkpoint=True, mlp_chunks=chunks, loss_chunks="auto")
    model.train()
    ids = torch.randint(0, 56, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    shard = shard_batch({"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(TOKENS)[None]}, mesh)
    model(**shard).loss.backward()
    q_proj, calls = model.model.layers[0].self_attn.q_proj, [0]
    handle = q_proj.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    with ForwardGemms(q_proj.weight) as gemms:
        model(**shard).loss.backward()
    handle.remove()
    unpatch(model)
    return gemms.n, calls[0]


def rows() -> list[tuple]:
    out = []
    for mode in MODES:
        for u in (2, 8):
            lo, hi = step_traffic(mode, u, 2), step_traffic(mode, u, 4)
            out.append((mode, u, lo, {k: (hi[k] - lo[k]) / 2 for k in lo}))
    return out


def main() -> None:
    print("Parameter-gradient traffic, one fwd+bwd step, tiny Llama (hidden 32, 90 tokens, 1 process)")
    print("| mode | row chunks u | per layer: fresh param-sized tensors | bytes | add kernels | bytes | "
          "per step (2 layers): fresh | bytes | adds | bytes | vector params: fresh / adds per layer |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, u, step, layer in rows():
        print(f"| {mode} | {u} | {layer['fresh']:g} | {layer['fresh_bytes']:g} | {layer['adds']:g} | "
              f"{layer['add_bytes']:g} | {step['fresh']} | {step['fresh_bytes']} | {step['adds']} | {step['add_bytes']} | "
              f"{layer['vector_fresh']:g} / {layer['vector_adds']:g} |")
    print("\nq_proj of one decoder layer, one fwd+bwd step, memory='max' knobs (checkpoint=True, mlp_chunks=u)")
    print("| row chunks u | forward GEMMs (reading its weight) | module calls | 2u |")
    print("|---|---|---|---|")
    for u in (2, 8):
        gemms, calls = projection_gemms(u)
        print(f"| {u} | {gemms} | {calls} | {2 * u} |")


if __name__ == "__main__":
    main()
