"""The bad-input matrix: every mistake a user can make on the documented path, each asserting
WHERE it is caught (patch(), the trainer's construction, init_sequence_parallel -- all before
any collective) and that the message names the offending value and what to do instead.

docs/concepts/exactness.md ("Reliability") counts the rows of this file (`CASES` below plus the
parametrised TrainingArguments table); a new refusal gets its row here.
"""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest
import torch

from hf_longctx import LongContextTrainer, NotSupported, init_group_bank, init_sequence_parallel, patch
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.training.refusals.training_arguments import TRAINER_PARAMETERS, TRAINING_ARGUMENTS
from tests.helpers.families import save_family
from tests.helpers.trainer_cases import make_dataset, training_args


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return save_family("llama", tmp_path_factory.mktemp("bad"))


def _model(path, mesh=None, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return patch(model, mesh) if mesh is not None else model


def _trainer(path, tmp_path, *, args=None, **kw):
    mesh = init_sequence_parallel()
    kw = {"model": _model(path, mesh), "train_dataset": make_dataset(), "mesh": mesh, "max_tokens": 48,
          "tokens_per_step": 120, **kw}
    return LongContextTrainer(args=args or training_args(str(tmp_path)), **kw)


def _local_mesh(ulysses: int) -> SPMesh:
    """A mesh description without groups: patch() validates it without any collective."""
    return SPMesh(dp=1, ring=1, ulysses=ulysses, fpdt_chunks=1, dp_rank=0, ring_rank=0, ulysses_rank=0)


def _says(err: BaseException, *needles: str) -> None:
    text = str(err)
    assert isinstance(err, NotSupported) and "do instead" in text.lower(), text
    for needle in needles:
        assert needle in text, f"{needle!r} not in: {text}"


# -- TrainingArguments: every field classified, every refused value refused at construction ----------
BAD_ARGUMENTS = {
    "per_device_eval_batch_size": 2,
    "average_tokens_across_devices": False,
    "neftune_noise_alpha": 5.0,
    "bf16_full_eval": True,
    "eval_accumulation_steps": 2,
    "batch_eval_metrics": True,
    "dataloader_drop_last": True,
    "label_names": ["targets"],
    "remove_unused_columns": False,
    "length_column_name": "n_tokens",
    "ignore_data_skip": True,
    "enable_jit_checkpoint": True,
    "gradient_checkpointing_kwargs": {"preserve_rng_state": False},
    "auto_find_batch_size": True,
    "ddp_find_unused_parameters": True,
}


def test_every_training_argument_and_trainer_parameter_is_classified():
    from transformers import Trainer, TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert fields - set(TRAINING_ARGUMENTS) == set(), "classify these new TrainingArguments fields in training/refusals/training_arguments.py"
    params = set(inspect.signature(Trainer.__init__).parameters) - {"self"}
    assert params - set(TRAINER_PARAMETERS) == set(), "classify these new Trainer parameters in training/refusals/training_arguments.py"
    for name, rule in {**TRAINING_ARGUMENTS, **TRAINER_PARAMETERS}.items():
        assert rule.kind in ("trainer", "ours", "mapped", "refused"), name
        assert (rule.ok is not None and bool(rule.instead)) == (rule.kind == "refused"), name


@pytest.mark.parametrize("name", sorted(BAD_ARGUMENTS))
def test_refused_training_argument_at_construction(llama_path, tmp_path, name):
    args = training_args(str(tmp_path), **{name: BAD_ARGUMENTS[name]})
    with pytest.raises(NotSupported) as info:
        _trainer(llama_path, tmp_path, args=args)
    _says(info.value, f"{name}={getattr(args, name)!r}")


def test_unclassified_training_argument_is_refused_when_set(tmp_path, monkeypatch):
    from hf_longctx.training.refusals import training_arguments as arguments
    from hf_longctx.training.refusals.checks import check_training_arguments

    table = dict(arguments.TRAINING_ARGUMENTS)
    del table["eval_delay"]  # as if a newer transformers had added it
    monkeypatch.setattr(arguments, "TRAINING_ARGUMENTS", table)
    check_training_arguments(training_args(str(tmp_path)))  # at its default: nothing to say
    with pytest.raises(NotSupported) as info:
        check_training_arguments(training_args(str(tmp_path), eval_delay=3))
    _says(info.value, "eval_delay=3", "not classified")


# -- Trainer parameters ------------------------------------------------------------------------------
def _collator_that_raises(features):
    raise AssertionError("a refused collator must never run")


BAD_PARAMETERS = {
    "data_collator": (_collator_that_raises, "'labels' column"),
    "model_init": (lambda: None, "model_init"),
    "preprocess_logits_for_metrics": (lambda logits, labels: logits, "sharded"),
    "compute_metrics": (lambda p: {}, "compute_metrics is not supported"),
    "compute_loss_func": (lambda outputs, labels, num_items_in_batch=None: outputs.loss, "global target count"),
}


@pytest.mark.parametrize("name", sorted(BAD_PARAMETERS))
def test_refused_trainer_parameter(llama_path, tmp_path, name):
    value, needle = BAD_PARAMETERS[name]
    with pytest.raises(NotSupported) as info:
        _trainer(llama_path, tmp_path, **{name: value})
    _says(info.value, name, needle)


def test_optimizer_built_before_sharding_is_refused(llama_path, tmp_path):
    mesh = init_sequence_parallel()
    model = _model(llama_path, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NotSupported) as info:
        LongContextTrainer(model=model, args=training_args(str(tmp_path)), train_dataset=make_dataset(), mesh=mesh,
                           max_tokens=48, tokens_per_step=120, optimizers=(opt, None))
    _says(info.value, "optimizers", "optimizer_cls_and_kwargs")


def test_positional_data_collator_is_refused_too(llama_path, tmp_path):
    mesh = init_sequence_parallel()
    model = _model(llama_path, mesh)
    with pytest.raises(NotSupported) as info:
        LongContextTrainer(model, training_args(str(tmp_path)), _collator_that_raises, make_dataset(), mesh=mesh,
                           max_tokens=48, tokens_per_step=120)
    _says(info.value, "data_collator")


# -- settings that would change silently --------------------------------------------------------------
def _checkpoint_field():
    from transformers import TrainingArguments

    from hf_longctx._compat import checkpointing_fields

    return checkpointing_fields(TrainingArguments)[0]  # activation_checkpointing; 5.17: gradient_checkpointing


def test_explicit_checkpoint_false_wins_over_the_trainer_flag_and_is_said(llama_path, tmp_path):
    from hf_longctx.integrations.model_patch import patch_state

    field = _checkpoint_field()
    mesh = init_sequence_parallel()
    model = patch(_model(llama_path), mesh, checkpoint=False)
    with pytest.warns(UserWarning, match=rf"TrainingArguments\({field}=True\) is not applied: the model was patched "
                                         r"with checkpoint=False explicitly"):
        LongContextTrainer(model=model, args=training_args(str(tmp_path), **{field: True}), train_dataset=make_dataset(),
                           mesh=mesh, max_tokens=48, tokens_per_step=120)
    assert patch_state(model).options.checkpoint is False
    model = patch(_model(llama_path), mesh)  # no explicit checkpoint=: the Trainer's flag turns it on
    LongContextTrainer(model=model, args=training_args(str(tmp_path), **{field: True}), train_dataset=make_dataset(),
                       mesh=mesh, max_tokens=48, tokens_per_step=120)
    assert patch_state(model).options.checkpoint is True


def test_training_arguments_are_never_rewritten(llama_path, tmp_path):
    """The same TrainingArguments object builds a second trainer with the same settings."""
    from hf_longctx.integrations.model_patch import patch_state

    field = _checkpoint_field()
    args = training_args(str(tmp_path), **{field: True})
    before = args.to_dict()
    for _ in range(2):
        mesh = init_sequence_parallel()
        model = _model(llama_path, mesh)
        LongContextTrainer(model=model, args=args, train_dataset=make_dataset(), mesh=mesh, max_tokens=48,
                           tokens_per_step=120)
        assert patch_state(model).options.checkpoint is True  # the second trainer too
    assert args.to_dict() == before


def test_truncation_is_said_once_with_the_counts(llama_path, tmp_path):
    import warnings

    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": [list(range(1, 61)), list(range(1, 11)), list(range(1, 51))]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(llama_path, tmp_path, train_dataset=ds, max_tokens=48, tokens_per_step=120, overlong="truncate")
    said = [str(w.message) for w in caught if "overlong='truncate'" in str(w.message)]
    assert len(said) == 1, said
    for needle in ("2 of 3 document(s) of train_dataset exceed max_tokens=48", "document 0, has 60 tokens",
                   "their tails, 14 of 120 tokens (11.7 %), are never trained", "overlong='split'"):
        assert needle in said[0], said[0]


def test_dpo_batch_size_refusal_says_what_to_set(tmp_path):
    """LongDPOTrainer sizes its step in tokens of whole pairs: the refusal and the DPO guide
    both say so."""
    pytest.importorskip("trl")
    import pathlib

    from trl import DPOConfig

    from hf_longctx.training.refusals.checks import check_training_arguments

    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_length=None, use_cpu=True, report_to=[])
    with pytest.raises(NotSupported) as info:
        check_training_arguments(args, "LongDPOTrainer")
    _says(info.value, "LongDPOTrainer cannot honour these DPOConfig settings", "per_device_train_batch_size=4",
          "tokens_per_step=", "chosen + rejected tokens of whole pairs")
    dpo = (pathlib.Path(__file__).parents[2] / "docs" / "guides" / "dpo.md").read_text()
    assert "per_device_train_batch_size" in dpo and "tokens_per_step" in dpo


# -- the mesh and the process group -------------------------------------------------------------------
def test_mesh_before_the_process_group_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun / accelerate launch set; no group in this process
    for build in (lambda: init_sequence_parallel(ulysses_degree=1), lambda: init_sequence_parallel(ulysses_degree=2),
                  lambda: init_group_bank(heads=4)):
        with pytest.raises(NotSupported) as info:
            build()
        _says(info.value, "WORLD_SIZE=2", "init_process_group")


def test_one_process_for_an_sp_degree_says_to_launch_more(monkeypatch):
    """`python recipes/demo.py`, `accelerate launch` without the config, or Accelerate's MULTI_CPU
    (one process without MPI): the fix is the launch, not the degrees."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(NotSupported) as info:
        init_sequence_parallel(ulysses_degree=2, ring_degree=2)
    _says(info.value, "= 4 does not divide world size 1: this process runs alone", "launch 4 processes",
          "torchrun --nproc-per-node 4", "num_processes: 4", "MULTI_GPU with use_cpu: true", "MULTI_CPU")


def _mesh_world_mismatch():
    from hf_longctx.training.refusals.checks import check_world

    try:
        check_world(1)  # a mesh of one rank (built before the group) under a world of 2
    except NotSupported as e:
        return str(e)
    return None


def test_trainer_refuses_a_mesh_smaller_than_the_world(pools):
    for message in pools.get(2).run(_mesh_world_mismatch, timeout=60):
        assert message is not None and "mesh spans 1 rank(s) but torch.distributed has 2" in message


# -- patch(): what the first forward would find, said at patch() ---------------------------------------
def test_ulysses_degree_above_the_heads_refused_at_patch(llama_path):
    model = _model(llama_path)  # 4 query heads, 2 KV heads
    with pytest.raises(NotSupported) as info:
        patch(model, _local_mesh(8))
    _says(info.value, "query heads (4) must be divisible by ulysses degree (8)", "[1, 2, 4]")
    patch(model, _local_mesh(4))  # 4 heads over 4 ranks (KV heads replicated): accepted


def test_fp16_weights_refused_at_patch(llama_path):
    model = _model(llama_path, dtype=torch.float16)
    with pytest.raises(NotSupported) as info:
        patch(model, init_sequence_parallel())
    _says(info.value, "float16 weights", "torch.bfloat16")


def test_patch_signature_reads_well():
    assert "object at" not in str(inspect.signature(patch))


def _bert(**kw):
    import transformers as tf

    cfg = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    return tf.BertLMHeadModel(tf.BertConfig(**{**cfg, **kw}))


def test_bert_is_refused_as_an_encoder_not_for_its_dropout():
    with pytest.raises(NotSupported) as info:
        patch(_bert(), _local_mesh(2))  # BERT's defaults: is_decoder=False, attention dropout 0.1
    _says(info.value, "BertLMHeadModel is an encoder", "bidirectional", "decoder-only causal LM")
    assert "dropout" not in str(info.value), str(info.value)


def test_causal_bert_refused_for_its_shared_head_bias_at_patch():
    """A causal BERT (is_decoder=True, no dropout) passes the dry run, but its LM head owns one
    bias twice: FSDP2 would fail at the first forward; refused at patch() with that cause."""
    model = _bert(is_decoder=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with pytest.raises(NotSupported) as info:
        patch(model, _local_mesh(2))
    _says(info.value, "cls.predictions.decoder.bias", "cls.predictions.bias", "one Parameter in 2 FSDP2 units")
    assert "is an encoder" not in str(info.value)


def test_encoder_decoder_refused_by_cause_not_a_leaked_exception():
    import transformers as tf

    model = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                      num_heads=4, dropout_rate=0.0))
    with pytest.raises(NotSupported) as info:
        patch(model, _local_mesh(2))
    text = str(info.value)
    _says(info.value, "T5ForConditionalGeneration is an encoder-decoder model", "cross-attends")
    assert "Error" not in text.splitlines()[1], text  # the first cause, not a leaked AttributeError


def test_meta_model_refused_at_construction_naming_every_tensor(llama_path, tmp_path):
    """A model on the meta device passes patch() (the non-zero ranks of broadcast_from_rank0 are
    patched on meta) but no trainer can train it: refused at construction, naming every meta
    parameter (the first 8, then the count) and buffer, with the way to materialise -- which then
    works: to_empty, init_weights (RoPE's buffers), load_state_dict, and the trainer accepts it."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    mesh = init_sequence_parallel()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llama_path))
    patch(model, mesh)
    with pytest.raises(NotSupported) as info:
        LongContextTrainer(model=model, args=training_args(str(tmp_path)), train_dataset=make_dataset(), mesh=mesh,
                           max_tokens=48, tokens_per_step=120)
    _says(info.value, "LongContextTrainer: the model LlamaForCausalLM has 21 parameter(s) (model.embed_tokens.weight, "
          "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight, ... and 13 more)",
          "2 buffer(s) (model.rotary_emb.inv_freq, model.rotary_emb.original_inv_freq) on the meta device",
          "from_pretrained(path) without device_map='meta'", "model.to_empty(device='cpu'), then model.init_weights()",
          "model.load_state_dict(state_dict)")
    model.to_empty(device="cpu")
    model.init_weights()
    model.load_state_dict(load_file(f"{llama_path}/model.safetensors"))
    LongContextTrainer(model=model, args=training_args(str(tmp_path)), train_dataset=make_dataset(), mesh=mesh,
                       max_tokens=48, tokens_per_step=120)


def _lora(model, dropout: float):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "v_proj"]))


def test_lora_dropout_refused_at_patch_and_at_construction(llama_path, tmp_path):
    """LoRA's dropout draws its masks per rank on each shard: refused at patch() (the model is in
    eval mode there, as from_pretrained leaves it: the check reads the modules, not the mode),
    at the trainer's construction when the adapter was added after patch(), naming the field,
    the value, the modules and the fix; lora_dropout=0.0 is accepted."""
    pytest.importorskip("peft")
    fix = "create the adapter with lora_dropout=0.0 (e.g. LoraConfig(..., lora_dropout=0.0) for LoRA)"
    model = _lora(_model(llama_path).eval(), 0.05)
    with pytest.raises(NotSupported) as info:
        patch(model, init_sequence_parallel())
    _says(info.value, "PEFT adapter 'default' has lora_dropout=0.05 in 4 module(s) (model.layers.0.self_attn.q_proj, "
          "model.layers.0.self_attn.v_proj, model.layers.1.self_attn.q_proj, ... (1 more))", fix,
          "PeftModel.from_pretrained(model, path, config=config, is_trainable=True)")
    mesh = init_sequence_parallel()
    late = _lora(_model(llama_path, mesh), 0.1)  # patched first, the adapter added afterwards
    with pytest.raises(NotSupported) as info:
        LongContextTrainer(model=late, args=training_args(str(tmp_path)), train_dataset=make_dataset(), mesh=mesh,
                           max_tokens=48, tokens_per_step=120)
    _says(info.value, "LongContextTrainer cannot train this model exactly", "lora_dropout=0.1 in 4 module(s)", fix)
    patch(_lora(_model(llama_path), 0.0), init_sequence_parallel())  # no dropout: accepted


def test_sft_peft_config_with_dropout_refused_at_construction(llama_path, tmp_path):
    """TRL's SFTTrainer(peft_config=...) adds the adapter inside its constructor, after patch():
    a config with dropout is refused before it, naming the value."""
    pytest.importorskip("trl")
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from hf_longctx import LongContextTrainerMixin

    class LongSFT(LongContextTrainerMixin, SFTTrainer):
        pass

    mesh = init_sequence_parallel()
    args = SFTConfig(output_dir=str(tmp_path), max_length=None, use_cpu=True, report_to=[], bf16=False)
    with pytest.raises(NotSupported) as info:
        LongSFT(model=_model(llama_path, mesh), args=args, train_dataset=make_dataset(), mesh=mesh, max_tokens=48,
                tokens_per_step=120, peft_config=LoraConfig(r=4, lora_dropout=0.05, target_modules=["q_proj"]))
    _says(info.value, "peft_config is not supported (peft_config=LoraConfig(lora_dropout=0.05))", "adapter dropout",
          "LoraConfig(..., lora_dropout=0.0)")


def _fsdp_refuses_split_parameter():
    from transformers import AutoModelForCausalLM

    from hf_longctx import fsdp_plan
    from tests.helpers.families import family_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("llama"))
    layers = model.model.layers
    layers[1].mlp.up_proj.weight = layers[0].mlp.up_proj.weight  # one Parameter in two decoder layers
    try:
        fsdp_plan(model, init_sequence_parallel(ulysses_degree=2)).apply(model)
    except NotSupported as e:
        return str(e), any(hasattr(m, "reshard") for m in model.modules())
    return None, True


def test_fsdp_plan_refuses_a_parameter_shared_between_units_before_sharding(pools):
    for message, sharded in pools.get(2).run(_fsdp_refuses_split_parameter, timeout=120):
        assert message is not None and not sharded, message
        for needle in ("model.layers.0.mlp.up_proj.weight (in model.layers.0)",
                       "model.layers.1.mlp.up_proj.weight (in model.layers.1)", "2 FSDP2 units", "Do instead"):
            assert needle in message, message


# -- the data ------------------------------------------------------------------------------------------
def test_empty_dataset_is_named_empty(llama_path, tmp_path):
    from datasets import Dataset

    with pytest.raises(ValueError, match=r"train_dataset is empty \(0 rows"):
        _trainer(llama_path, tmp_path, train_dataset=Dataset.from_dict({}))


def test_tokens_per_step_below_a_document(llama_path, tmp_path):
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": [list(range(1, 41)), list(range(1, 11))]})
    with pytest.raises(NotSupported) as info:
        _trainer(llama_path, tmp_path, train_dataset=ds, tokens_per_step=30)
    _says(info.value, "tokens_per_step=30", "document 0, has 40 tokens", "at least 40")
    with pytest.warns(UserWarning, match="tokens_per_step=30 is smaller than 1 document"):
        _trainer(llama_path, tmp_path, train_dataset=ds, tokens_per_step=30, max_tokens=32, overlong="split")


def test_dataset_smaller_than_one_step_is_said(llama_path, tmp_path):
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": [list(range(1, 21)), list(range(1, 11))]})
    with pytest.warns(UserWarning, match="holds 30 tokens in 2 document"):
        _trainer(llama_path, tmp_path, train_dataset=ds, tokens_per_step=120)


@pytest.mark.parametrize("bad", [10**6, 128, -5])
def test_token_id_outside_the_embedding_is_named_at_construction(llama_path, tmp_path, bad):
    """An id the embedding table does not hold: named (document, position, id) at construction on
    every rank alike, not an IndexError mid-forward on the rank whose shard holds it."""
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": [list(range(1, 9)), [5, 6, 7, bad, 8, 9]]})
    with pytest.raises(NotSupported) as info:
        _trainer(llama_path, tmp_path, train_dataset=ds)
    _says(info.value, "train_dataset document 1, position 3", f"token id {bad}", "embedding table of 128 rows",
          "resize_token_embeddings")


def test_label_outside_the_head_is_named_at_construction(llama_path, tmp_path):
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 2, "labels": [[1, 2, 3, 4], [-100, 2, 300, 4]]})
    with pytest.raises(NotSupported) as info:
        _trainer(llama_path, tmp_path, train_dataset=ds)
    _says(info.value, "train_dataset document 1, position 2: labels holds 300", "neither -100")


def test_token_id_checked_per_step_before_any_forward(llama_path, tmp_path):
    """Rows the construction scan could not see (a transform applied when a row is read) are
    checked in the step's collator, before planning, sharding or any forward."""
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": [list(range(1, 9)), list(range(1, 7))]})
    trainer = _trainer(llama_path, tmp_path, train_dataset=ds, args=training_args(str(tmp_path), max_steps=1))

    def corrupt(batch):
        return {"input_ids": [[*ids[:2], 999, *ids[3:]] if len(ids) == 6 else ids for ids in batch["input_ids"]]}

    trainer.train_dataset = ds.with_transform(corrupt)
    with pytest.raises(NotSupported) as info:
        trainer.train()
    _says(info.value, "train_dataset document 1, position 2", "token id 999")


@pytest.mark.parametrize("mask,needle", [
    ([1, 1, 0, 1, 0, 0], "'attention_mask' is not right or left padding: its 6 entries form 4 runs"),
    ([0, 0, 0, 0, 0, 0], "'attention_mask' has no 1 in its 6 entries"),
])
def test_padded_rows_that_are_not_one_document_are_named_at_construction(llama_path, tmp_path, mask, needle):
    """A padded dataset's `attention_mask` keeps each row's real tokens (right or left padding); a
    row whose mask has holes, or no real token, is named at construction with the fix."""
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 9, 0], [2, 3, 0, 4, 0, 0]],
                            "attention_mask": [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], mask]})
    with pytest.raises(NotSupported) as info:
        _trainer(llama_path, tmp_path, train_dataset=ds)
    _says(info.value, f"train_dataset document 2: {needle}")


@pytest.mark.parametrize("column", ["input_ids", "labels"])
def test_float_token_columns_are_named_at_construction(llama_path, tmp_path, column):
    """Ids or labels stored as floats (a pandas / JSON round trip) were cast silently (labels) or
    refused at step 1 (ids): named at construction, with the cast that fixes them."""
    from datasets import Dataset

    ids = [[1, 2, 3, 4], [5, 6, 7, 8]]
    cols = {"input_ids": ids, "labels": ids}
    cols[column] = [[float(t) for t in row] for row in ids]
    with pytest.raises(NotSupported) as info:
        _trainer(llama_path, tmp_path, train_dataset=Dataset.from_dict(cols))
    _says(info.value, f"train_dataset: column '{column}' holds double values (List(Value('float64'))), not integers",
          f"train_dataset.cast_column('{column}', datasets.Sequence(datasets.Value('int64')))")


def test_all_masked_labels_are_named_at_construction(llama_path, tmp_path):
    """A labels column that leaves no target (every label -100, or only on each document's first
    token, which the per-document shift never trains) was refused at step 1 without a fix."""
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": [[1, 2, 3, 4], [5, 6, 7]], "labels": [[1, -100, -100, -100], [-100] * 3]})
    with pytest.raises(NotSupported) as info:
        _trainer(llama_path, tmp_path, train_dataset=ds)
    _says(info.value, "every label of train_dataset's 2 row(s) is -100", "no token carries loss",
          "labels are HF's unshifted targets", "drop the 'labels' column to learn every token")


def test_labels_of_the_wrong_length_say_what_to_do(llama_path, tmp_path):
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": [[1, 2, 3, 4], [5, 6, 7, 8]], "labels": [[1, 2, 3, 4], [5, 6, 7]]})
    with pytest.raises(ValueError) as info:
        _trainer(llama_path, tmp_path, train_dataset=ds, args=training_args(str(tmp_path), max_steps=1)).train()
    text = str(info.value)
    for needle in ("document 1: 'labels' has 3 entries but input_ids has 4", "one entry per input token",
                   "drop the column"):
        assert needle in text, text


def test_resume_from_a_missing_checkpoint_names_the_fix(llama_path, tmp_path):
    trainer = _trainer(llama_path, tmp_path, args=training_args(str(tmp_path / "run"), max_steps=1))
    with pytest.raises(NotSupported) as info:
        trainer.train(resume_from_checkpoint=str(tmp_path / "missing"))
    _says(info.value, f"resume_from_checkpoint='{tmp_path / 'missing'}' does not exist", "holds no checkpoint",
          "resume_from_checkpoint=None")
    with pytest.raises(NotSupported) as info:
        trainer.train(resume_from_checkpoint=True)
    _says(info.value, f"output_dir '{tmp_path / 'run'}' holds no checkpoint-N directory", "save_strategy='steps'")
    (tmp_path / "run" / "checkpoint-3").mkdir(parents=True)  # a directory, but not a checkpoint
    with pytest.raises(NotSupported) as info:
        trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    _says(info.value, "is not a complete checkpoint: no trainer_state.json", "holds checkpoint-3 (incomplete)")
    with pytest.raises(NotSupported) as info:
        trainer.train(resume_from_checkpoint=True)  # the newest COMPLETE checkpoint-N: there is none
    _says(info.value, "no checkpoint under output_dir", "'checkpoint-3' (no trainer_state.json",
          "resume_from_checkpoint=None")
    assert "True" not in info.value.instead, info.value.instead


# -- what the trainer writes ---------------------------------------------------------------------------
def test_saved_config_keeps_the_models_use_cache(llama_path, tmp_path):
    trainer = _trainer(llama_path, tmp_path, args=training_args(str(tmp_path), max_steps=1))
    assert trainer.model.config.use_cache is False  # the Trainer's training-time value (TrainingArguments.use_cache)
    trainer.train()
    trainer.save_model(str(tmp_path / "export"))
    saved = json.loads((tmp_path / "export" / "config.json").read_text())
    assert saved["use_cache"] is True  # as the model was loaded (LlamaConfig's default)
    assert trainer.model.config.use_cache is False  # training state unchanged after the save


def test_trainer_docstring_is_real():
    doc = LongContextTrainer.__doc__
    assert "see the mixin" not in doc and "tokens_per_step" in doc and "max_tokens" in doc


def test_every_sft_config_field_is_classified(tmp_path):
    pytest.importorskip("trl")
    from transformers import TrainingArguments
    from trl import SFTConfig

    from hf_longctx.training.refusals.sft import SFT_CONFIG
    from hf_longctx.training.refusals.checks import check_training_arguments

    extra = {f.name for f in dataclasses.fields(SFTConfig)} - {f.name for f in dataclasses.fields(TrainingArguments)}
    assert extra - set(SFT_CONFIG) == set(), "classify these new SFTConfig fields in training/refusals/sft.py"
    from transformers import Trainer
    from trl import SFTTrainer

    from hf_longctx.training.refusals.sft import SFT_TRAINER_PARAMETERS
    from hf_longctx.training.refusals.training_arguments import refused_parameters

    params = set(inspect.signature(SFTTrainer.__init__).parameters) - set(inspect.signature(Trainer.__init__).parameters)
    assert params - set(SFT_TRAINER_PARAMETERS) == set(), "classify these new SFTTrainer parameters in training/refusals/sft.py"
    assert refused_parameters({"quantization_config": None, "peft_config": object(), "formatting_func": str}) == []
    (line,) = refused_parameters({"quantization_config": {"load_in_4bit": True}})
    assert line.startswith("quantization_config is not supported (quantization_config={'load_in_4bit': True})") and "drop it" in line
    ok = dict(output_dir=str(tmp_path), max_length=None, use_cpu=True, report_to=[], gradient_checkpointing=False)
    check_training_arguments(SFTConfig(**ok))  # TRL's defaults (max_length=None aside) are accepted
    for name, value in {"pad_to_multiple_of": 8, "eval_packing": True, "model_init_kwargs": {"dtype": "float32"}}.items():
        with pytest.raises(NotSupported) as info:
            check_training_arguments(SFTConfig(**ok, **{name: value}))
        _says(info.value, f"SFTConfig.{name}=")


def test_mixer_refusal_is_not_supported_too(tmp_path):
    """A refused linear mixer (Jamba's Mamba-1) raises the same class, with a do-instead line."""
    import transformers as tf

    from benchmarks.zoo import tiny_config

    model = tf.AutoModelForCausalLM.from_config(tiny_config(tf.CONFIG_MAPPING["jamba"]))
    with pytest.raises(NotSupported) as info:
        patch(model, _local_mesh(2))
    _says(info.value, "Mamba")


# -- post-training: pairs over the cap, a reference with another vocabulary or tokenizer ----------------
def _dpo(llama_path, tmp_path, *, ref_model=None, max_tokens=64):
    from transformers import AutoTokenizer
    from trl import DPOConfig

    from hf_longctx import LongDPOTrainer
    from tests.helpers.dpo_cases import _text_pairs
    from tests.helpers.word_tokenizer import make_tokenizer

    make_tokenizer(str(tmp_path / "tok"))
    mesh = init_sequence_parallel()
    args = DPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to=[], max_length=None)
    return LongDPOTrainer(model=_model(llama_path, mesh), ref_model=ref_model, args=args, train_dataset=_text_pairs(),
                          processing_class=AutoTokenizer.from_pretrained(str(tmp_path / "tok")), mesh=mesh,
                          max_tokens=max_tokens, tokens_per_step=4096)


def _other_reference(tmp_path, **changes):
    """A Llama like `save_family("llama")` with `changes` to its config, saved; (its path, the model)."""
    import transformers as tf

    from tests.helpers.families import family_config

    cfg = family_config("llama")
    for k, v in changes.items():
        setattr(cfg, k, v)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(tmp_path / "other_ref"))
    return str(tmp_path / "other_ref"), model


def test_dpo_pair_over_the_token_cap_is_named_at_construction(llama_path, tmp_path):
    pytest.importorskip("trl")
    with pytest.raises(ValueError) as info:
        _dpo(llama_path, tmp_path, max_tokens=16)
    for needle in ("pair(s) exceed max_tokens=16", "chosen and rejected padded", "raise max_tokens or drop long pairs"):
        assert needle in str(info.value), str(info.value)


@pytest.mark.parametrize("change,named", [(dict(vocab_size=200), "vocab_size 200 (policy 128)"),
                                          (dict(eos_token_id=7), "eos_token_id 7")], ids=["vocabulary", "tokenizer"])
def test_dpo_reference_with_another_vocabulary_is_refused(llama_path, tmp_path, change, named):
    pytest.importorskip("trl")
    _, ref = _other_reference(tmp_path, **change)
    with pytest.raises(ValueError) as info:
        _dpo(llama_path, tmp_path, ref_model=ref)
    assert named in str(info.value) and "Do instead" in str(info.value), str(info.value)


def test_grpo_reference_with_another_vocabulary_is_refused_before_trl_loads_it(llama_path, tmp_path):
    """beta > 0: TRL loads the reference from the policy's config._name_or_path; its config is
    read first and refused by its vocabulary size."""
    pytest.importorskip("trl")
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    from hf_longctx.training.grpo.trainer import LongGRPOTrainer
    from tests.helpers.grpo_cases import make_prompts, reward_length
    from tests.helpers.word_tokenizer import make_tokenizer

    path, _ = _other_reference(tmp_path, vocab_size=200)
    make_tokenizer(str(tmp_path / "tok"))
    mesh = init_sequence_parallel()
    model = _model(llama_path, mesh)
    model.config._name_or_path = path
    cfg = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2, report_to=[],
                     use_cpu=True, bf16=False, gradient_checkpointing=False, save_strategy="no", beta=0.04)
    with pytest.raises(ValueError, match=r"vocab_size 200 \(policy 128\)(.|\n)*Do instead"):
        LongGRPOTrainer(model=model, mesh=mesh, reward_funcs=[reward_length], args=cfg, train_dataset=make_prompts(),
                        processing_class=AutoTokenizer.from_pretrained(str(tmp_path / "tok")))


# -- vision-language data: caught in shard_multimodal / MultimodalCollator, before the model or any collective --
def test_multimodal_row_of_several_documents_without_boundaries():
    """Two documents, each starting with the model's BOS, packed into one row with neither
    position_ids nor cu_seq_lens_q: refused naming the row, the token, its position and the fix."""
    from hf_longctx import vision_spec
    from hf_longctx.data.multimodal.sharding import shard_multimodal
    from tests.helpers.vlm_cases import build, mixed_documents, packed_row

    model = build("qwen2_5_vl")
    docs = mixed_documents("qwen2_5_vl")[:2]
    for d in docs:
        d["input_ids"] = torch.cat([torch.tensor([model.config.text_config.bos_token_id]), d["input_ids"]])
    row = {k: v for k, v in packed_row(docs).items() if k != "position_ids"}
    with pytest.raises(NotSupported) as info:
        shard_multimodal(row, _local_mesh(1), vision_spec(model))
    _says(info.value, "row 0 of the batch", "holds several documents but carries no boundaries",
          f"position(s) [{len(docs[0]['input_ids'])}]", "position_ids restarting at 0", "cu_seq_lens_q")


def test_multimodal_spec_contradicting_the_patched_model():
    """An explicit VisionSpec of another model next to the patched model's own: refused naming both."""
    from hf_longctx import vision_spec
    from hf_longctx.data.multimodal.collator import MultimodalCollator
    from tests.helpers.vlm_cases import build

    mesh = init_sequence_parallel()
    model = patch(build("qwen2_5_vl"), mesh, unsafe_skip_exactness_check=True)
    with pytest.raises(NotSupported) as info:
        MultimodalCollator(mesh, 96, vision_spec(build("gemma3")), model=model)
    _says(info.value, "spec (gemma3) contradicts the VisionSpec patch() remembered on model= (qwen2_5_vl)", "pass only model=")
