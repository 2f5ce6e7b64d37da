"""memory="max" returns a row-chunked decoder layer's output in the form the layer returns it.

Bamba's decoder layers return (hidden states, attention weights) and its model unpacks two
values; the row-chunked layer returned the hidden states alone (ValueError: not enough values to
unpack, from the first step). Now a tuple comes back with the layer's further entries (None
here), and two steps equal memory="off" (fp32, one process). A layer returning further tensors
is refused naming their types (they would be the last row chunk's alone).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

from benchmarks.zoo_configs import tiny_config
from tests.helpers.patched_steps import patched_steps, worst_errors

torch.set_num_threads(1)
MAX_KNOBS = dict(checkpoint=True, mlp_chunks=4, loss_chunks="auto")


def test_a_layer_returning_a_tuple_gets_a_tuple_back_and_stays_exact():
    torch.manual_seed(0)
    base = tf.AutoModelForCausalLM.from_config(tiny_config(tf.CONFIG_MAPPING["bamba"]), dtype=torch.float32)
    got = patched_steps(copy.deepcopy(base), **MAX_KNOBS)
    loss_err, grad_err = worst_errors(got, patched_steps(copy.deepcopy(base), memory="off"))
    assert loss_err <= 1e-6 and grad_err <= 1e-5, (loss_err, grad_err)
    assert got[2], "no attention layer of Bamba took the row-chunked path"


def test_a_layer_returning_further_tensors_is_refused():
    """The form check itself (a model whose decoder layers return further tensors does not reach
    it through patch(): the dry run refuses it first)."""
    from hf_longctx.integrations.layer_split import LayerSplit

    split = LayerSplit.__new__(LayerSplit)
    split.extra = (torch.zeros(2),)
    with pytest.raises(RuntimeError, match=r"returns tensors after its hidden states \(\['Tensor'\]\)"):
        split._as_returned(torch.nn.Linear(2, 2), torch.zeros(1, 2, 2))
    split.extra = (None,)
    out = torch.zeros(1, 2, 2)
    assert split._as_returned(torch.nn.Linear(2, 2), out) == (out, None) and split.extra is None
