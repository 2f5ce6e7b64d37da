"""Per-token log-probabilities through the row-chunked LM head (ops/chunked_logprobs.py,
integrations/logprob_head.py) against the full logits.

The op: log-probs, entropy, mean logit and top-1 of fp64 inputs (bias, softcap, temperature)
equal the unchunked computation's exactly, and the gradients of a random cotangent to fp32
rounding (the log-softmax is fp32 by design; its gradient formula is written out); under CPU bf16 autocast the backward replays the forward's autocast (the gradients
equal the unchunked autograd's to bf16 GEMM blocking noise, and differ at bf16's epsilon when
the replay is removed). The integration: a patched tiny Llama on a one-process mesh under the
memory presets, and a softcapped Gemma2, give the log-probs (with and without gradients: the
frozen reference's forward) and parameter gradients of the unpatched model's full logits (fp32,
1e-5 / 1e-4 relative), Cohere's logit_scale included; a rescaling in a form
`integrations/logit_maps.py` does not read is refused. The allocation check: a TorchDispatchMode records
every op output with a vocabulary-wide dimension during GRPO's reference forward, policy
forward and backward; none holds more rows than one chunk, and with one chunk (loss_chunks=1:
the fault) the check sees [S_local, V] tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hf_longctx.ops.chunked_logprobs import STATS, chunked_token_logprobs


def _full(h, w, b, targets, temperature, softcap):
    logits = F.linear(h, w, b)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    z = logits.float() / temperature
    logp = torch.log_softmax(z, -1)
    t = targets.clamp_min(0)
    stats = torch.stack([-(logp.exp() * logp).sum(-1), z.mean(-1), (z.argmax(-1) == t).float()], -1)
    return logp.gather(-1, t[..., None])[..., 0], stats


@pytest.mark.parametrize("softcap,temperature", [(None, 1.0), (None, 0.7), (3.0, 0.7)])
def test_op_matches_full_logits(softcap, temperature):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 37, 16, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(50, 16, dtype=torch.float64, generator=g).requires_grad_()
    b = torch.randn(50, dtype=torch.float64, generator=g).requires_grad_()
    targets = torch.randint(0, 50, (2, 37), generator=g)
    targets[0, :5] = -100
    cot = torch.randn(2, 37, generator=g)
    got, stats = chunked_token_logprobs(h, w, b, targets=targets, chunk_size=7, temperature=temperature,
                                        final_logit_softcapping=softcap, stats=STATS)
    want, want_stats = _full(h, w, b, targets, temperature, softcap)
    assert not stats.requires_grad
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(stats, want_stats, rtol=0, atol=1e-12)
    grads = torch.autograd.grad((got * cot).sum(), [h, w, b])
    for mine, ref in zip(grads, torch.autograd.grad((want * cot).sum(), [h, w, b])):
        # The log-softmax runs in fp32 by design; its gradient is written out (log-softmax's backward
        # formula), whose fp32 roundings differ from autograd's fused kernel by ~1e-7.
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)


def test_op_backward_replays_autocast():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(64, 32, generator=g).requires_grad_()
    w = torch.randn(96, 32, generator=g).requires_grad_()
    targets = torch.randint(0, 96, (1, 64), generator=g)
    cot = torch.randn(1, 64, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = chunked_token_logprobs(h[None], w, targets=targets, chunk_size=16)
        want, _ = _full(h[None], w, None, targets, 1.0, None)
    # The hidden states' gradient, row by row the same ops chunked or not (the weight's sums chunks in fp32).
    (mine,) = torch.autograd.grad((got * cot).sum(), [h])
    (ref,) = torch.autograd.grad((want * cot).sum(), [h])
    plain, _ = _full(h[None], w, None, targets, 1.0, None)  # fp32 logits: what a backward without autocast sees
    (fp32,) = torch.autograd.grad((plain * cot).sum(), [h])
    err, bf16_err = ((mine - ref).norm() / ref.norm()).item(), ((fp32 - ref).norm() / ref.norm()).item()
    assert err < 1e-3 < bf16_err, (err, bf16_err)


def _mesh():
    from hf_longctx.distributed.mesh import init_sequence_parallel

    return init_sequence_parallel(1, 1)


def _tiny(family: str = "llama"):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    if family == "gemma2":
        cfg = tf.Gemma2Config(**common, head_dim=8, final_logit_softcapping=2.0, attn_logit_softcapping=None,
                              sliding_window=4096)
    elif family == "cohere":
        cfg = tf.CohereConfig(**common, logit_scale=0.5)
    else:
        cfg = tf.LlamaConfig(**common)
    return tf.AutoModelForCausalLM.from_config(cfg).float().train()


def _shard(n: int = 320, seed: int = 0):
    from hf_longctx.data.sharding import shard_batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 160, (1, n), generator=g)
    labels = ids.clone()
    labels[0, : n // 3] = -100
    pos = torch.arange(n)[None]  # one document (the unpatched reference attends across packed ones)
    return {"input_ids": ids, "labels": labels, "position_ids": pos}, shard_batch


@pytest.mark.parametrize("family,memory", [("llama", "off"), ("llama", "max"), ("llama", "max+keep"), ("gemma2", "balanced"),
                                           ("cohere", "balanced")])
def test_token_logprobs_match_the_full_logits(family, memory):
    from hf_longctx import patch, unpatch
    from hf_longctx.integrations.logprob_head import token_logprobs
    from hf_longctx.integrations.model_patch import patch_state

    batch, shard_batch = _shard()
    model = _tiny(family)
    cot = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(3))
    targets = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits  # the model's softcap
    logp = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, targets.clamp_min(0)[..., None])[..., 0]
    mask = targets != -100
    (logp * cot * mask).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    mesh = _mesh()
    patch(model, mesh, memory=memory.split("+")[0], keep_attention=memory.endswith("+keep"))
    try:
        shard = shard_batch(batch, mesh)
        with torch.no_grad():  # a frozen reference's forward (memory="max": row-chunked layers, nothing kept,
            # the attention's output not kept either with keep_attention)
            frozen, _ = token_logprobs(model, shard, temperature=0.7)
        split = patch_state(model).split
        assert split is None or split.no_grad_runs == 2, split.no_grad_runs  # both layers took the row-chunked path
        got, stats = token_logprobs(model, shard, temperature=0.7, stats=("entropy",))
        (got * cot * mask).sum().backward()
    finally:
        unpatch(model)
    torch.testing.assert_close(got[mask], logp[mask].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(frozen[mask], logp[mask].detach(), rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        err = (p.grad - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)
        assert err <= 1e-4, f"{n}: {err:.2e}"


def test_a_logit_rescaling_in_an_unread_form_is_refused():
    import transformers as tf

    from hf_longctx.errors import NotSupported
    from hf_longctx.integrations.logprob_head import check_logprob_head

    assert check_logprob_head(_tiny("gemma2")) == 2.0 and check_logprob_head(_tiny()) is None
    assert check_logprob_head(_tiny("cohere")) is None  # its logit_scale is read (and honoured: above)

    class OddCohere(tf.CohereForCausalLM):
        def forward(self, input_ids=None, **kwargs):  # the scaling in a form logit_maps does not read
            return torch.mul(self.lm_head(self.model(input_ids=input_ids).last_hidden_state), self.logit_scale)

    with pytest.raises(NotSupported, match="logit_scale=0.5"):
        check_logprob_head(OddCohere(_tiny("cohere").config))


class _VocabWide(TorchDispatchMode):
    """Rows of the largest op output with a dimension equal to the vocabulary."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and self.vocab in t.shape:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def _largest_vocab_rows(loss_chunks: int) -> tuple[int, int, int]:
    """(largest vocabulary-wide op's rows, the shard's rows, the head's chunk rows); loss_chunks 0:
    memory="balanced" ("auto" chunks) with 100-row chunks, as the planner lowers them (a
    240-token shard is shorter than an "auto" chunk)."""
    from hf_longctx import patch
    from hf_longctx.integrations.logprob_head import logprob_chunk_rows
    from hf_longctx.training.grpo.loss import GRPOObjective, add_ref_logps, grpo_loss, pack_completions, shard_completions

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 160, (20,), generator=g).tolist() for _ in range(4)]
    completions = [torch.randint(1, 160, (60,), generator=g).tolist() for _ in range(4)]
    objective = GRPOObjective(beta=0.04, temperature=0.7)
    packed = pack_completions(prompts, completions, [0.5, -0.5, 1.0, -1.0], objective, num_sequences=4, num_tokens=240)
    mesh = _mesh()
    options = {"memory": "balanced", "loss_chunk_rows": 100} if loss_chunks == 0 else {"loss_chunks": loss_chunks}
    model = patch(_tiny(), mesh, unsafe_skip_exactness_check=True, **options)  # a Llama: the dry run is covered above
    ref = patch(_tiny(), mesh, unsafe_skip_exactness_check=True, **options).eval().requires_grad_(False)
    shard = shard_completions(packed, mesh)
    watch = _VocabWide(160)
    with watch:
        add_ref_logps(ref, shard, objective)
        loss, _ = grpo_loss(model, shard, objective, mesh, num_sequences=4)
        loss.backward()
    s_local = shard["input_ids"].shape[1]
    return watch.rows, s_local, logprob_chunk_rows(model, s_local)


def test_no_sequence_by_vocabulary_tensor():
    rows, s_local, chunk = _largest_vocab_rows(0)  # memory="balanced": loss_chunks="auto", the trainer's rule
    assert chunk == 100 < s_local and max(chunk, 32) >= rows, (rows, chunk, s_local)  # 32: the [V, Hd] weight gradient
    rows, _, _ = _largest_vocab_rows(4)
    assert rows <= -(-s_local // 4)
    rows, _, _ = _largest_vocab_rows(1)  # the fault: one chunk holds every row
    assert rows >= s_local, "the check must see a [S_local, V] tensor when the head runs unchunked"


class _WeightSized(TorchDispatchMode):
    """Counts fresh op outputs of the LM head weight's shape [V, Hd] (new storage: not a view of,
    nor written in place into, an input)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        self.count += sum(isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape
                          and t.untyped_storage().data_ptr() not in given for t in tree_flatten(out)[0])
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_summed_in_place_whatever_the_chunks(dtype):
    """The head's weight gradient: each chunk's GEMM writes into one fp32 sum (ops/grad_sums.py),
    so the [V, Hd] tensors of the backward (the sum, the one rounding to the weight's dtype and
    the cast weight under bf16) do not grow with the number of chunks; a fresh per-chunk gradient
    added into the sum (the fault) gives one more per chunk. The gradient equals the unchunked one."""
    torch.manual_seed(0)
    n, hd, v = 64, 16, 40
    h = torch.randn(n, hd, dtype=dtype, requires_grad=True)
    w = (torch.randn(v, hd) * 0.3).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,))
    counts, grads = [], []
    for chunk in (32, 8):
        logps, _ = chunked_token_logprobs(h[None], w, None, targets=targets[None], chunk_size=chunk)  # [1, n]
        w.grad = None
        with _WeightSized(w.shape) as seen:
            logps.sum().backward()
        counts.append(seen.count)
        grads.append(w.grad.double())
    assert counts[0] == counts[1] and counts[1] <= 3, counts
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=(1e-6 if dtype == torch.float32 else 2**-7) * grads[0].abs().max().item())
