"""What patch(fused=True) changes on a model, and that unpatch() puts it back exactly.

No step runs here (nothing of a model compiles: `torch.compile` wrappers are lazy); the steps are
tests/distributed/test_fused.py (exactness) and tests/unit/test_fused_kernels.py (kernels).
- `integrations/rebind.rebound`: a copy of a decorated function whose innermost body reads
  another value for one global name; the original chain and its module keep theirs; the copy
  and the original compile apart under torch.compile (a graph break in each).
- A patched Llama: every norm (the final one included) and every attention module of the
  layers has an instance forward, the MLPs the fused one, the model a compiled loss function;
  the classes, transformers' modeling module and a second, unpatched Llama are untouched;
  unpatch() leaves no instance attribute behind.
- A family of another form (GPT-2: Conv1D attention without RoPE, an ungated MLP) keeps those
  modules unfused, named in one warning; a non-bool `fused` is refused naming the value.
"""

from __future__ import annotations

import functools

import pytest
import torch

READ = "original"


def _wrap(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


@_wrap
def _reads_global() -> str:
    return READ


@_wrap
def _scaled(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    print("a graph break")  # dynamo installs the resumed code's names in the frame's globals
    return y + float(len(READ))


def test_a_rebound_copy_compiles_apart_from_the_original():
    """torch.compile keeps compiled code per code object, with names installed in the globals
    of the frame it compiled: a copy sharing the original's code would run the original's
    compiled code under its own globals (NameError of a `__resume_at` / `__compiled_fn`)."""
    import contextlib
    import io

    import torch._dynamo

    from hf_longctx.integrations.rebind import rebound

    torch._dynamo.reset()
    copy = rebound(_scaled, "READ", "rebound!")
    x = torch.ones(2)
    with contextlib.redirect_stdout(io.StringIO()):
        assert torch.compile(_scaled, backend="eager")(x).tolist() == [10.0, 10.0]  # len("original") + 2
        assert torch.compile(copy, backend="eager")(x).tolist() == [10.0, 10.0]  # len("rebound!") + 2
        assert torch.compile(rebound(_scaled, "READ", "other"), backend="eager")(x).tolist() == [7.0, 7.0]
    torch._dynamo.reset()


def test_rebound_reads_the_new_value_and_leaves_the_original():
    from hf_longctx.integrations.rebind import global_read, rebound

    copy = rebound(_reads_global, "READ", "rebound")
    assert copy() == "rebound" and _reads_global() == "original" and READ == "original"
    assert global_read(_reads_global, "READ") == "original" and global_read(copy, "READ") == "rebound"
    with pytest.raises(ValueError, match="reads no global 'MISSING'"):
        rebound(_reads_global, "MISSING", 1)


def _llama():
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2))


def test_fused_patch_changes_instances_only_and_unpatches_exactly():
    from transformers.models.llama import modeling_llama

    from hf_longctx import init_sequence_parallel
    from hf_longctx.integrations.model_patch import patch, patch_state, unpatch

    mesh = init_sequence_parallel(1, 1)
    model, other = _llama(), _llama()
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    rope, attention_forward = modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaAttention.forward
    patch(model, mesh, fused=True)
    fused = patch_state(model).fusion.fused
    assert fused == {"norm": 5, "rope": 2, "mlp": 2, "loss": "whole"}, fused
    layer = model.model.layers[0]
    for module in (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm, layer.self_attn, layer.mlp):
        assert "forward" in module.__dict__, type(module).__name__
    assert "_loss_function" in model.__dict__
    assert modeling_llama.apply_rotary_pos_emb is rope and modeling_llama.LlamaAttention.forward is attention_forward
    assert not any("forward" in m.__dict__ for m in other.modules())
    unpatch(model)
    after = {name: dict(m.__dict__) for name, m in model.named_modules()}
    assert {n: set(d) for n, d in after.items()} == {n: set(d) for n, d in before.items()}


def test_other_forms_run_unfused_and_bad_values_are_refused():
    import transformers as tf

    from hf_longctx import init_sequence_parallel
    from hf_longctx.integrations.model_patch import patch, patch_state

    mesh = init_sequence_parallel(1, 1)
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    with pytest.warns(UserWarning, match="GPT2Attention, GPT2MLP run unfused"):
        patch(gpt2, mesh, fused=True)
    assert patch_state(gpt2).fusion.fused == {"norm": 5, "rope": 0, "mlp": 0, "loss": "whole"}
    with pytest.raises(ValueError, match="fused must be True or False, got 'yes'"):
        patch(_llama(), mesh, fused="yes")
