"""Tests for hf_longctx.ops.tiling and ops.chunked_loss: chunked MLP and chunked LM head + cross-entropy (FPDT).

Every numeric test compares forward AND backward with the unchunked reference (the HF MLP module
itself; transformers' ForCausalLMLoss on full logits). The memory tests watch every tensor storage
allocated while the op runs (a TorchDispatchMode plus weakref finalizers on storages) and bound
the peak of live bytes, so they fail if a full intermediate or full logits tensor ever exists.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import (
    Gemma2Config,
    GPT2Config,
    GPTBigCodeConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.models.gpt_bigcode.modeling_gpt_bigcode import GPTBigCodeMLP
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXMLP
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.mistral.modeling_mistral import MistralMLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

from hf_longctx.ops.chunked_loss import chunked_causal_lm_loss
from hf_longctx.ops.tiling import chunked_mlp, default_mlp_chunks, mlp_chunks_at

torch.set_num_threads(1)

HD, INTER = 32, 64
_HEADS = dict(num_attention_heads=4)

MLP_FACTORIES = {
    "llama": lambda: LlamaMLP(LlamaConfig(hidden_size=HD, intermediate_size=INTER, **_HEADS)),
    "mistral": lambda: MistralMLP(MistralConfig(hidden_size=HD, intermediate_size=INTER, **_HEADS)),
    "qwen2": lambda: Qwen2MLP(Qwen2Config(hidden_size=HD, intermediate_size=INTER, **_HEADS)),
    "qwen3": lambda: Qwen3MLP(Qwen3Config(hidden_size=HD, intermediate_size=INTER, **_HEADS)),
    "phi3": lambda: Phi3MLP(Phi3Config(hidden_size=HD, intermediate_size=INTER, **_HEADS)),
    "gemma2": lambda: Gemma2MLP(Gemma2Config(hidden_size=HD, intermediate_size=INTER, head_dim=8, **_HEADS)),
    "gpt2": lambda: GPT2MLP(INTER, GPT2Config(n_embd=HD, n_head=4, resid_pdrop=0.0)),
    "gpt_neox": lambda: GPTNeoXMLP(GPTNeoXConfig(hidden_size=HD, intermediate_size=INTER, **_HEADS)),
    "gpt_bigcode": lambda: GPTBigCodeMLP(INTER, GPTBigCodeConfig(n_embd=HD, n_head=4, resid_pdrop=0.0)),
}


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the mode and still alive (CPU allocator has
    no peak counter, so we count storages ourselves). Inputs and parameters created before the
    mode are not counted: the measurement is the op's extra memory."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest_numel = 0
        self._alive: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._alive.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Storages of the inputs: an output on one of them is a view or an in-place result and
        # allocates nothing (e.g. the transpose of a parameter must not count as new memory).
        input_keys = {id(a.untyped_storage()) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            self.largest_numel = max(self.largest_numel, t.numel())
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._alive or key in input_keys:
                continue
            self._alive.add(key)
            self.live += storage.nbytes()
            weakref.finalize(storage, self._free, key, storage.nbytes())
            self.peak = max(self.peak, self.live)
        return out


def _grads(outputs, inputs, grad_outputs=None):
    return torch.autograd.grad(outputs, inputs, grad_outputs=grad_outputs)


# ----------------------------------------------------------------------------------- chunked MLP


@pytest.mark.parametrize("family", sorted(MLP_FACTORIES))
@pytest.mark.parametrize("chunks", [2, 3, 5, 50])  # 13 tokens: uneven splits and chunks > S
def test_chunked_mlp_matches_module(family: str, chunks: int) -> None:
    torch.manual_seed(0)
    # float64: chunking changes only the summation order of parameter grads, so the default
    # float64 tolerance (rtol 1e-7, atol 1e-7) is ample and still catches any real error.
    mlp = MLP_FACTORIES[family]().double()
    params = [p for p in mlp.parameters()]
    hidden = torch.randn(2, 13, HD, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 13, HD, dtype=torch.float64)

    ref = mlp(hidden)
    ref_grads = _grads(ref, [hidden, *params], grad_out)
    out = chunked_mlp(mlp.forward, hidden, chunks)
    grads = _grads(out, [hidden, *params], grad_out)

    torch.testing.assert_close(out, ref)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg)


def test_chunked_mlp_fp32_and_no_grad() -> None:
    torch.manual_seed(1)
    mlp = MLP_FACTORIES["phi3"]()
    hidden = torch.randn(1, 17, HD, requires_grad=True)
    ref = mlp(hidden)
    ref.square().sum().backward()
    ref_grads = [hidden.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    hidden.grad = None
    mlp.zero_grad(set_to_none=True)

    out = chunked_mlp(mlp.forward, hidden, 4)
    out.square().sum().backward()  # .backward() path: grads accumulate into .grad as usual
    # fp32 defaults (rtol 1.3e-6, atol 1e-5): per-token math is identical, only the parameter
    # grad summation is split into chunks.
    torch.testing.assert_close(out, ref)
    for g, rg in zip([hidden.grad] + [p.grad for p in mlp.parameters()], ref_grads):
        torch.testing.assert_close(g, rg)
    with torch.no_grad():
        torch.testing.assert_close(chunked_mlp(mlp.forward, hidden, 4), ref)


def test_chunked_mlp_one_chunk_of_intermediates_alive() -> None:
    torch.manual_seed(2)
    seq, hd, inter, chunks = 128, 8, 256, 8  # intermediates dwarf hidden-sized tensors
    mlp = LlamaMLP(LlamaConfig(hidden_size=hd, intermediate_size=inter, num_attention_heads=2))
    hidden = torch.randn(1, seq, hd, requires_grad=True)
    full_intermediate = seq * inter * 4  # one fp32 [B, S, I] tensor

    def measure(fn):
        with LiveBytes() as fwd:
            out = fn()
        kept_after_forward = fwd.live
        with LiveBytes() as bwd:
            out.sum().backward()
        return kept_after_forward, max(fwd.peak, bwd.peak)

    ref_kept, ref_peak = measure(lambda: mlp(hidden))
    kept, peak = measure(lambda: chunked_mlp(mlp.forward, hidden, chunks))

    # Sanity: the tracker sees the reference keep several full intermediates (gate, act, up).
    assert ref_kept >= 3 * full_intermediate
    # Chunked forward keeps no intermediate at all for backward: only hidden-sized tensors.
    assert kept < full_intermediate / 4, (kept, full_intermediate)
    # Peak over forward+backward: what the reference peaks at, divided over the chunks, plus
    # hidden-sized terms (output, upstream grad, grad of hidden, cat buffer: 4 x [B, S, Hd]) and
    # parameter grads (accumulated grad + one chunk's grad: 2 x params). Fails both without
    # recomputation (forward keeps everything) and with one recompute of all chunks at once.
    hidden_sized = 4 * seq * hd * 4 + 2 * sum(p.numel() * 4 for p in mlp.parameters())
    assert peak <= 1.5 * ref_peak / chunks + hidden_sized, (peak, ref_peak)
    assert peak < ref_peak / 2


def test_chunked_mlp_rejects_bad_args() -> None:
    mlp = MLP_FACTORIES["llama"]()
    with pytest.raises(ValueError, match="chunks=0"):
        chunked_mlp(mlp.forward, torch.randn(1, 4, HD), 0)
    with pytest.raises(ValueError, match="shape"):
        chunked_mlp(mlp.forward, torch.randn(4, HD), 2)


@pytest.mark.parametrize("grad", [True, False])
def test_chunked_mlp_of_a_moe_returning_router_scores(grad: bool) -> None:
    """GPT-OSS's MLP returns (hidden [B, S, Hd], router scores [B·S, k]): the chunked MLP returns
    both as the unchunked call does (the scores joined batch-major over uneven chunks), and the
    hidden states' gradients equal the module's. An output not per token is refused."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    torch.manual_seed(0)
    mlp = GptOssMLP(GptOssConfig(hidden_size=HD, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2))
    for p in mlp.parameters():  # the experts' weights are made uninitialised (the model's _init_weights fills them)
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 13, HD, requires_grad=True)
    with torch.set_grad_enabled(grad):
        want, want_scores = mlp(x)
        got, scores = chunked_mlp(mlp.forward, x, 3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(scores, want_scores, rtol=0, atol=0)
    assert scores.shape == (2 * 13, 2)  # top-2 of 4 experts per token
    if grad:
        g = torch.randn_like(want)
        (dx_want,) = torch.autograd.grad(want, x, g)
        (dx_got,) = torch.autograd.grad(got, x, g)
        torch.testing.assert_close(dx_got, dx_want, rtol=1e-5, atol=1e-6)

    def pooled(h):  # a second output of one row per batch: not per token
        return h * 2, h.mean(1)

    with pytest.raises(ValueError, match=r"output 2 is \(2, 32\)"):
        chunked_mlp(pooled, torch.randn(2, 13, HD), 3, params=[])


def test_gpt_oss_under_balanced_knobs_equals_memory_off() -> None:
    """A GPT-OSS user's path with memory="balanced"'s knobs (chunked MLP returning router
    scores, chunked loss; 3 MLP chunks, where "auto" takes one chunk at this length): loss and
    every gradient equal memory="off" (fp32, one process)."""
    import copy

    import transformers as tf

    from hf_longctx import init_sequence_parallel, patch, unpatch
    from hf_longctx.data.sharding import shard_batch

    torch.manual_seed(0)
    base = tf.GptOssForCausalLM(tf.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=8))
    ids = torch.randint(1, 64, (1, 60), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.cat([torch.arange(35), torch.arange(25)])[None]}
    out = []
    for options in ({"memory": "off"}, {"mlp_chunks": 3, "loss_chunks": "auto"}):  # "balanced"'s knobs, 3 chunks
        model = copy.deepcopy(base).train()
        mesh = init_sequence_parallel(1, 1)
        patch(model, mesh, **options)
        loss = model(**shard_batch(batch, mesh)).loss
        loss.backward()
        unpatch(model)
        out.append((loss.detach(), [p.grad for p in model.parameters()]))
    (ref, ref_grads), (loss, grads) = out
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    top = max(float(g.abs().max()) for g in ref_grads if g is not None)
    for a, b in zip(grads, ref_grads):
        assert (a is None) == (b is None) and (a is None or float((a - b).abs().max()) <= 1e-5 * top)


# --------------------------------------------------------------------------- chunked LM head loss


def _reference_loss(hidden, weight, bias, labels, num_items, softcap, maps=()):
    """The HF path: full logits from lm_head, the model's scaling (Cohere's `logits * scale`,
    Granite's `logits / scaling`) and Gemma2 softcap in the model dtype, ForCausalLMLoss."""
    logits = F.linear(hidden, weight, bias)  # [B, S, V]
    for op, value in maps:
        logits = logits * value if op == "*" else logits / value
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return ForCausalLMLoss(
        logits, None, vocab_size=weight.shape[0], num_items_in_batch=num_items, shift_labels=labels
    )


def _labels(b: int, s: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    labels[torch.rand(b, s, generator=gen) < 0.3] = -100  # ignored positions, as after shifting
    labels[:, -1] = -100
    return labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_items", [None, 37, "tensor"])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_chunked_loss_matches_for_causal_lm_loss(dtype, num_items, softcap, with_bias, chunk_size) -> None:
    torch.manual_seed(3)
    b, s, hd, vocab = 2, 11, 16, 50
    hidden = torch.randn(b, s, hd, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, hd, dtype=dtype, requires_grad=True)
    bias = torch.randn(vocab, dtype=dtype, requires_grad=True) if with_bias else None
    labels = _labels(b, s, vocab, seed=4)
    n_items = torch.tensor(37) if num_items == "tensor" else num_items
    inputs = [hidden, weight] + ([bias] if with_bias else [])

    ref = _reference_loss(hidden, weight, bias, labels, n_items, softcap)
    ref_grads = _grads(ref * 3.0, inputs)  # upstream grad != 1 exercises the backward scaling
    loss = chunked_causal_lm_loss(
        hidden, weight, bias, shift_labels=labels, num_items_in_batch=n_items,
        chunk_size=chunk_size, final_logit_softcapping=softcap,
    )
    grads = _grads(loss * 3.0, inputs)

    # Same per-token ops as the reference; only the order of the token sum (loss, weight and
    # bias grads) changes, so the dtype's default tolerance holds: the loss is fp32 for both
    # (ForCausalLMLoss calls .float(), even on fp64 logits: rtol 1.3e-6 / atol 1e-5) and the
    # grads keep the input dtype (fp64: rtol 1e-7 / atol 1e-7).
    assert loss.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(loss, ref)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg)


@pytest.mark.parametrize("maps", [(), (("*", 3.0),), (("/", 4.0),)], ids=["plain", "times-3", "over-4"])
@pytest.mark.parametrize("autocast", [False, True])
def test_chunked_loss_bf16_and_autocast(autocast: bool, maps: tuple) -> None:
    torch.manual_seed(9)
    b, s, hd, vocab = 2, 33, 16, 64
    dtype = torch.float32 if autocast else torch.bfloat16  # autocast: fp32 master weights, bf16 GEMMs
    hidden = torch.randn(b, s, hd, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, hd, dtype=dtype, requires_grad=True)
    bias = torch.randn(vocab, dtype=dtype, requires_grad=True)
    labels = _labels(b, s, vocab, seed=10)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref = _reference_loss(hidden, weight, bias, labels, 20, 2.0, maps)
        loss = chunked_causal_lm_loss(hidden, weight, bias, shift_labels=labels, num_items_in_batch=20,
                                      chunk_size=5, final_logit_softcapping=2.0, logit_maps=maps)
    ref_grads = _grads(ref, [hidden, weight, bias])
    grads = _grads(loss, [hidden, weight, bias])
    assert loss.dtype == torch.float32 and all(g.dtype == dtype for g in grads)
    # Loss: bf16 logits are the same per token, the CE runs in fp32 -> fp32 tolerance.
    torch.testing.assert_close(loss, ref)
    # Hidden grad: per-token, same bf16 ops -> fp32 tolerance on the upcast values.
    torch.testing.assert_close(grads[0].float(), ref_grads[0].float())
    # Weight/bias grads: the reference rounds one bf16 GEMM over all tokens, we round each of the
    # 14 chunk GEMMs to bf16 and sum in fp32: differences of a few bf16 ulps (2^-8 relative).
    for g, rg in zip(grads[1:], ref_grads[1:]):
        torch.testing.assert_close(g.float(), rg.float(), rtol=2**-6, atol=2**-6 * rg.abs().max().item())


def test_chunked_loss_tied_embedding_and_frozen_head() -> None:
    torch.manual_seed(5)
    b, s, hd, vocab = 2, 9, 16, 40
    emb = torch.nn.Embedding(vocab, hd)
    proj = torch.nn.Linear(hd, hd)
    ids = torch.randint(0, vocab, (b, s))
    labels = _labels(b, s, vocab, seed=6)

    def run(loss_fn):
        emb.zero_grad(set_to_none=True)
        proj.zero_grad(set_to_none=True)
        hidden = torch.tanh(proj(emb(ids)))  # [B, S, Hd]; emb.weight reaches the loss twice
        loss_fn(hidden).backward()
        return [emb.weight.grad.clone(), proj.weight.grad.clone(), proj.bias.grad.clone()]

    ref = run(lambda h: _reference_loss(h, emb.weight, None, labels, None, None))
    got = run(lambda h: chunked_causal_lm_loss(h, emb.weight, shift_labels=labels, chunk_size=4))
    for g, rg in zip(got, ref):  # fp32 defaults, see above
        torch.testing.assert_close(g, rg)

    # Frozen head (e.g. LoRA): no weight grad is computed or returned, hidden grad still exact.
    frozen = torch.randn(vocab, hd)
    hidden = torch.randn(b, s, hd, requires_grad=True)
    (ref_h,) = _grads(_reference_loss(hidden, frozen, None, labels, 10, None), [hidden])
    (got_h,) = _grads(chunked_causal_lm_loss(hidden, frozen, shift_labels=labels, num_items_in_batch=10,
                                             chunk_size=5), [hidden])
    torch.testing.assert_close(got_h, ref_h)
    with torch.no_grad():
        torch.testing.assert_close(
            chunked_causal_lm_loss(hidden, frozen, shift_labels=labels, chunk_size=5),
            _reference_loss(hidden, frozen, None, labels, None, None),
        )


def test_chunked_loss_never_materialises_full_logits() -> None:
    torch.manual_seed(7)
    b, s, hd, vocab, chunk = 2, 64, 8, 1024, 8
    n = b * s
    hidden = torch.randn(b, s, hd, requires_grad=True)
    weight = torch.randn(vocab, hd, requires_grad=True)
    labels = _labels(b, s, vocab, seed=8)
    full_logits_fp32 = n * vocab * 4

    def measure(fn):
        with LiveBytes() as mode:
            fn().backward()
        return mode.peak, mode.largest_numel

    ref_peak, ref_largest = measure(lambda: _reference_loss(hidden, weight, None, labels, None, None))
    peak, largest = measure(
        lambda: chunked_causal_lm_loss(hidden, weight, shift_labels=labels, chunk_size=chunk)
    )
    assert ref_largest >= n * vocab and ref_peak >= 2 * full_logits_fp32  # tracker sanity
    assert largest <= max(chunk * vocab, vocab * hd), largest  # no tensor beyond one chunk / weight
    # Four chunk-sized fp32 buffers (logits, log-softmax, their grads), weight-sized grads (fp32
    # accumulator, one chunk's grad, the returned grad) and hidden-sized grads; below even one
    # full fp32 logits tensor.
    bound = 4 * chunk * vocab * 4 + 3 * vocab * hd * 4 + 4 * n * hd * 4
    assert peak <= bound < full_logits_fp32, (peak, bound, full_logits_fp32)


def test_chunked_loss_rejects_bad_args() -> None:
    hidden, weight, labels = torch.randn(1, 4, 8), torch.randn(10, 8), torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_size=0"):
        chunked_causal_lm_loss(hidden, weight, shift_labels=labels, chunk_size=0)
    with pytest.raises(ValueError, match=r"shift_labels shape=\(1, 3\)"):
        chunked_causal_lm_loss(hidden, weight, shift_labels=labels[:, :3], chunk_size=2)
    with pytest.raises(ValueError, match=r"weight shape=\(10, 7\)"):
        chunked_causal_lm_loss(hidden, torch.randn(10, 7), shift_labels=labels, chunk_size=2)
    with pytest.raises(ValueError, match=r"bias shape=\(9,\)"):
        chunked_causal_lm_loss(hidden, weight, torch.randn(9), shift_labels=labels, chunk_size=2)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        chunked_causal_lm_loss(hidden, weight, shift_labels=labels, chunk_size=2, final_logit_softcapping=0.0)


# ------------------------------------------------------------------------------------- defaults


def test_defaults() -> None:
    assert default_mlp_chunks(1) == 2 and default_mlp_chunks(4) == 8
    assert default_mlp_chunks(1, 14336, 4096) == 14 and default_mlp_chunks(64, 14336, 4096) == 128  # >= ceil(4 I / Hd)
    assert mlp_chunks_at(14, 1 << 20, auto=True) == 14 and mlp_chunks_at(14, 4096, auto=True) == 4  # rows >= 1024
    assert mlp_chunks_at(14, 100, auto=True) == 1 and mlp_chunks_at(14, 100, auto=False) == 14
    with pytest.raises(ValueError, match="fpdt_chunks=0"):
        default_mlp_chunks(0)

