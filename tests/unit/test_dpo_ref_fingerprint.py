"""The pieces of the stored reference columns' checks, without a trainer.

`ids_hashes` (arrow, no Python lists) equals `ids_hash` row by row on a dataset, a selection
and a shuffled filter; `model_digest` is equal for the same weights in fp32 and bf16 and after
`patch(memory="max")`, and differs for other weights; `check_rescored` accepts a difference
within the dtype's tolerance and refuses one beyond it, naming the pair and the amounts;
`verify_ref_logps` values that are not a pair count, or that would verify nothing, are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def _pairs():
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 64, (n,), generator=g).tolist()  # noqa: E731
    return Dataset.from_list([{"prompt_ids": ids(i % 3), "chosen_ids": ids(2 + i % 4), "rejected_ids": ids(1 + i % 5)}
                              for i in range(12)])


def test_ids_hashes_equal_the_row_hash():
    from hf_longctx.training.dpo.ref_columns import ids_hash
    from hf_longctx.training.dpo.ref_fingerprint import ids_hashes

    pairs = _pairs()
    evens = pairs.shuffle(seed=1).filter(lambda r, i: i % 2 == 0, with_indices=True)
    for ds in (pairs, pairs.select([7, 2, 9]), evens):
        want = [ids_hash(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in ds]
        assert ids_hashes(ds).tolist() == want


def test_model_digest_reads_weights_not_dtype():
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_longctx import init_sequence_parallel, patch
    from hf_longctx.training.dpo.model_digest import model_digest

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    digest = model_digest(model)
    assert model_digest(LlamaForCausalLM(cfg)) != digest  # other weights
    other = LlamaForCausalLM(cfg)
    other.load_state_dict(model.state_dict())
    assert model_digest(other.to(torch.bfloat16)) == digest
    assert model_digest(patch(model, init_sequence_parallel(), memory="max")) == digest


def test_check_rescored_tolerance_and_message():
    from hf_longctx.training.dpo.ref_verify import check_rescored, tolerance

    stored = np.array([[-60.0, -30.0], [-40.0, -20.0]])
    tokens = np.array([[12.0, 6.0], [8.0, 4.0]])
    allowed = tolerance(torch.float32) * (np.abs(stored) + tokens)
    columns = ["ref_chosen_logps", "ref_rejected_logps"]
    check_rescored("train_dataset", [3, 5], stored, stored + 0.9 * allowed, tokens, torch.float32, columns)
    rescored = stored.copy()
    rescored[1, 1] += 2 * allowed[1, 1]
    says = (r"train_dataset: 1 of 2 rescored pairs disagree(.|\n)*pair 5: chosen stored -40, rescored -40 \(off by 0, "
            r"allowed 0.00039\), rejected stored -20, rescored -19.9996 \(off by 0.000389, allowed 0.00019\)(.|\n)*"
            r"Do instead: drop them")
    with pytest.raises(ValueError, match=says):
        check_rescored("train_dataset", [3, 5], stored, rescored, tokens, torch.float32, columns)
    # bf16's tolerance admits what fp32's refuses: the rescoring's own rounding is coarser
    check_rescored("train_dataset", [3, 5], stored, rescored, tokens, torch.bfloat16, columns)


@pytest.mark.parametrize("count,precompute,needle", [(True, True, "is not a number of pairs"),
                                                     (-1, True, "is not a number of pairs"),
                                                     (8, False, "precompute_ref_log_probs=False")])
def test_verify_option_refusals(tmp_path, count, precompute, needle):
    from trl import DPOConfig

    from hf_longctx.training.dpo.checks import check_verify_option

    args = DPOConfig(output_dir=str(tmp_path), max_length=None, precompute_ref_log_probs=precompute, report_to=[],
                     use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match=f"verify_ref_logps(.|\\n)*{needle}(.|\\n)*Do instead"):
        check_verify_option(count, args)
    check_verify_option(0, args)
