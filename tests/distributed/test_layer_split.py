"""memory="max" with row-chunked layers (integrations/layer_split.py): exact, on every layout.

One training step with memory="max" (every decoder layer run in row chunks split at its
attention call, FPDT streaming its chunks through them) gives the loss and EVERY gradient of
the same step with memory="off" (nothing chunked, no checkpointing): Ulysses, ring, U×R,
FPDT with and without K/V offload, a sliding window, attention sinks with an MoE, GPT-2's
Conv1D layers, Qwen3's per-head q/k norms, and FPDT's CUDA offload branch run on CPU with
emulated streams (pinned pool buffers, real copies). Tolerances (fp32): loss 1e-6 relative,
gradients 1e-5 relative (max|a-b| / max|b| per parameter): both run the same kernels on the
same inputs; only the order of fp32 sums differs (row chunks of the parameter gradients,
loss chunks), ~1e-7, while a lost chunk, a wrong row offset or a dropped residual moves a
gradient by >= 1e-2. Layers that cannot be cut (a linear mixer, dropout outside the MLP,
arguments not known to be per token) run whole-layer offloaded checkpointing with a warning,
and stay exact.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from hf_longctx.data.sharding import shard_batch
from hf_longctx.integrations.model_patch import patch, unpatch
from tests.helpers.pool import worker_mesh
from tests.helpers.layer_split_cases import GRAD_TOL, LOSS_TOL, _batch, _model, _step, assert_exact, errors_by_name

def _max(chunks: int, preset: bool) -> dict:
    """memory="max", or its knobs with 4 MLP / row chunks (the preset's "auto" makes chunks of at
    least 1024 rows: one chunk at this test's sizes)."""
    if preset:
        return {"memory": "max"}
    return dict(checkpoint=True, mlp_chunks=4, loss_chunks="auto", kv_offload=chunks > 1)


def _exact_case(family: str, ulysses: int, ring: int, chunks: int, emulate: bool, reference: str = "off",
                preset: bool = False):
    mesh = worker_mesh(ulysses, ring, chunks)
    base = _model(family)
    batch = _batch(base.config.vocab_size)
    ref, _ = _step(copy.deepcopy(base), mesh, batch, **({"memory": "off"} if reference == "off" else {"checkpoint": True}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if emulate:  # FPDT's and the checkpoint's CUDA offload branches, on CPU with real copies
            from benchmarks.census import EmulatedStreams
            from benchmarks.census import emulated_offload

            with emulated_offload(EmulatedStreams()):
                got, runs = _step(copy.deepcopy(base), mesh, batch, **_max(chunks, preset))
        else:
            got, runs = _step(copy.deepcopy(base), mesh, batch, **_max(chunks, preset))
    errs = errors_by_name(base, got, ref)
    return errs, runs, [str(w.message) for w in caught if "memory='max'" in str(w.message)]


LAYOUTS = [  # (world, family, ulysses, ring, fpdt chunks, emulated offload copies)
    (2, "llama", 2, 1, 1, False),
    (2, "llama", 2, 1, 2, "preset"),
    (2, "llama", 1, 2, 1, False),
    (4, "llama", 2, 2, 1, False),
    (2, "llama", 2, 1, 2, False),
    (2, "llama", 2, 1, 2, True),
    (4, "llama", 4, 1, 2, False),
    (2, "mistral", 2, 1, 2, False),
    (2, "qwen3", 2, 1, 2, False),
    (2, "gpt_oss", 2, 1, 2, False),
    (2, "gpt_oss", 2, 1, 1, False),
    (2, "gpt2", 2, 1, 4, False),
]


@pytest.mark.parametrize("world,family,ulysses,ring,chunks,emulate", LAYOUTS,
                         ids=[f"{f}-u{u}r{r}c{c}{'-' + (e if isinstance(e, str) else 'copies') if e else ''}"
                              for _, f, u, r, c, e in LAYOUTS])
def test_max_with_row_chunked_layers_equals_no_checkpointing(pools, world, family, ulysses, ring, chunks, emulate):
    preset = emulate == "preset"
    for rank, (errs, runs, warned) in enumerate(pools.get(world).run(_exact_case, family, ulysses, ring, chunks,
                                                                     emulate is True, "off", preset)):
        assert runs == {"chunked": 2, "whole": 0} and not warned, (runs, warned)  # both layers were cut
        assert_exact(errs, rank, family)


def test_a_hybrid_layer_runs_whole_and_says_why(pools):
    """A linear mixer needs the whole sequence: its layers run whole-layer offloaded
    checkpointing, a warning names the reason, and the step equals checkpoint=True's."""
    for errs, runs, warned in pools.get(2).run(_exact_case, "lfm2", 2, 1, 1, False, "checkpoint"):
        assert runs["whole"] >= 1 and warned and "mixer" in warned[0], (runs, warned)
        assert errs.pop("loss") <= LOSS_TOL
        assert max(errs.values()) <= GRAD_TOL, errs


def test_what_makes_a_layer_uncuttable():
    """The reasons `_uncut` gives (a layer call that cannot run in row chunks)."""
    import transformers as tf

    from hf_longctx.integrations.layer_split import _uncut

    layer = _model("llama").model.layers[0]
    h = torch.randn(1, 8, 32)
    cos = sin = torch.randn(1, 8, 8)
    assert _uncut(layer, (h,), {"position_embeddings": (cos, sin), "position_ids": torch.arange(8)[None],
                                "attention_mask": None, "use_cache": False}) == ""
    assert "per token" in _uncut(layer, (h,), {"token_type_ids": torch.zeros(1, 8)})
    assert "requires grad" in _uncut(layer, (h,), {"position_embeddings": (cos.requires_grad_(), sin)})
    assert "positional" in _uncut(layer, (h, torch.zeros(1, 8)), {})
    layer.extra = torch.nn.Dropout(0.1)
    assert "dropout extra" in _uncut(layer.train(), (h,), {})
    assert _uncut(layer.eval(), (h,), {}) == ""  # no dropout outside training
    del tf


# ---- one process: passes of the MLP, the discarded forward, the host budget ----------------------


def _mlp_rows_per_layer_and_token(**options) -> float:
    """Rows the MLP modules process in one step, per layer and per token of the sequence."""
    import transformers as tf

    from hf_longctx import init_sequence_parallel

    model = _model("llama")
    rows = [0]
    original = tf.models.llama.modeling_llama.LlamaMLP.forward

    def counted(self, x):
        rows[0] += x.shape[0] * x.shape[1]
        return original(self, x)

    mesh = init_sequence_parallel(1, 1, fpdt_chunks=options.pop("fpdt", 1))
    batch = _batch(model.config.vocab_size)
    tf.models.llama.modeling_llama.LlamaMLP.forward = counted  # before patch(): it binds the forward it finds
    try:
        patch(model, mesh, **options)
        model.train()
        shard = shard_batch(batch, mesh)
        rows[0] = 0  # not the dry run of patch()
        model(**shard).loss.backward()
    finally:
        tf.models.llama.modeling_llama.LlamaMLP.forward = original
    unpatch(model)
    return rows[0] / model.config.num_hidden_layers / shard["input_ids"].shape[1]


def test_max_runs_the_mlp_once_forward_and_once_backward():
    """memory="max" (row-chunked layers): each token passes the MLP twice per step -- the
    forward, and the backward's recompute of its chunk right before that chunk's gradient --
    with and without FPDT; whole-layer checkpointing with per-chunk MLP checkpoints inside
    (the layers that cannot be cut) passes it three times, no checkpointing once."""
    cut = dict(checkpoint=True, mlp_chunks=4, loss_chunks="auto")
    assert _mlp_rows_per_layer_and_token(**cut) == 2
    assert _mlp_rows_per_layer_and_token(fpdt=2, kv_offload=True, **cut) == 2
    assert _mlp_rows_per_layer_and_token(memory="off") == 1
    assert _mlp_rows_per_layer_and_token(checkpoint=True) == 2  # whole layer recomputed, MLP unchunked


def test_a_discarded_first_forward_keeps_nothing_for_the_backward(monkeypatch):
    """Whole-layer checkpointing (checkpoint=True without row chunks) with FPDT K/V offload, the
    CUDA branch on CPU: the first forward of each layer, whose saved tensors the checkpoint drops,
    puts no q or lse chunk and no K/V chunk beyond what its own later steps read; the recompute
    in the backward saves them. Gradients equal those without checkpointing."""
    from benchmarks.census import EmulatedStreams
    from benchmarks.census import emulated_offload
    from hf_longctx import init_sequence_parallel
    from hf_longctx.ops.offload import ChunkStore

    puts: list = []
    original = ChunkStore.put

    def put(self, key, *tensors):
        puts.append((torch.is_grad_enabled(), key))
        return original(self, key, *tensors)

    monkeypatch.setattr(ChunkStore, "put", put)
    mesh = init_sequence_parallel(1, 1, fpdt_chunks=2)
    base = _model("llama")
    batch = _batch(base.config.vocab_size)
    grads = {}
    for name, opts in (("ref", dict()), ("ckpt", dict(checkpoint=True, kv_offload=True))):
        model = copy.deepcopy(base)
        with emulated_offload(EmulatedStreams()):
            patch(model, mesh, **opts)
            model.train()
            shard = shard_batch(batch, mesh)
            puts.clear()
            loss = model(**shard).loss
            forward_puts = list(puts)
            puts.clear()
            loss.backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
        unpatch(model)
        if name == "ckpt":
            assert {k[0] for _, k in forward_puts} == {"kv"} and len(forward_puts) == 2, forward_puts  # chunk 0 per layer
            assert {("q", 0), ("q", 1), ("lse", 0), ("kv", 1)} <= {k for _, k in puts}  # the recompute saves
    for a, b in zip(grads["ckpt"], grads["ref"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _unread_by_layer(model) -> list[set]:
    """Per decoder layer: the names of the projections whose forward GEMM pre's backward skips."""
    from hf_longctx.integrations.model_patch import patch_state
    from hf_longctx.model_walk import decoder_layers

    state = patch_state(model)
    names = {id(m.weight): n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return [{names[i] for i in state.split.unread[id(layer)]} for layer in decoder_layers(model)]


QKV = {"q_proj", "k_proj", "v_proj"}


@pytest.mark.parametrize("family,unread", [("llama", QKV), ("mistral", QKV), ("qwen3", {"v_proj"})])
def test_pre_backward_runs_no_gemm_whose_output_no_backward_reads(family, unread):
    """memory="max": the backward's pass through pre (for the input's and the projections'
    gradients) skips the forward GEMMs of the projections whose outputs no backward reads --
    q, k, v under RoPE alone; v only where a q/k norm reads q and k (Qwen3) -- learnt per layer
    on its first rows, and the step stays exact (also on 2 ranks: the layouts above)."""
    from hf_longctx import init_sequence_parallel

    mesh = init_sequence_parallel()
    base = _model(family)
    batch = _batch(base.config.vocab_size)
    ref, _ = _step(copy.deepcopy(base), mesh, batch)
    model = copy.deepcopy(base)
    patch(model, mesh, checkpoint=True, mlp_chunks=3, loss_chunks="auto")
    model.train()
    model(**shard_batch(batch, mesh)).loss.backward()
    assert _unread_by_layer(model) == [unread] * base.config.num_hidden_layers
    unpatch(model)
    got, _ = _step(model, mesh, batch, checkpoint=True, mlp_chunks=3, loss_chunks="auto")
    assert_exact(errors_by_name(base, got, ref), 0, family)


def test_a_projection_whose_output_a_backward_reads_is_never_skipped(monkeypatch):
    """The fault the learning guards against: Qwen3's q and k feed its q/k norms, whose backward
    reads them; forcing their GEMMs off in pre's backward makes the gradients wrong."""
    from hf_longctx import init_sequence_parallel
    from hf_longctx.integrations import layer_run

    mesh = init_sequence_parallel()
    base = _model("qwen3")
    batch = _batch(base.config.vocab_size)
    ref, _ = _step(copy.deepcopy(base), mesh, batch)
    model = copy.deepcopy(base)
    qkv = frozenset(id(m.weight) for layer in model.model.layers for n, m in layer.self_attn.named_modules() if n in QKV)
    assert len(qkv) == 6

    def every_projection(slot, params, needs, grads_of):  # q, k and v "learnt" unread in every layer
        return frozenset(id(p) for p in params) & qkv
    monkeypatch.setattr(layer_run, "learn_unread", every_projection)
    got, _ = _step(model, mesh, batch, checkpoint=True, mlp_chunks=3, loss_chunks="auto")
    errs = errors_by_name(base, got, ref)
    assert any(not e <= GRAD_TOL for n, e in errs.items() if "q_proj" in n or "k_proj" in n), errs
