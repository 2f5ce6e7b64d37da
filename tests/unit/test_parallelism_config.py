"""Accelerate's `ParallelismConfig` mapped onto the hf_longctx mesh, field by field (no process group).

Each honoured field is checked by the degrees it gives (`map_parallelism_config`, pure); each
refused value by its message, which must name the field, the value and what to do instead; the
fields hf_longctx answers with its own mechanism (`sp_backend`, `cp_backend`, `cp_comm_strategy`,
`sp_attn_implementation`, `sp_seq_length_is_variable`) by the note the trainers say once. The
launcher's path: the PARALLELISM_CONFIG_* variables that `accelerate launch` exports are read by
Accelerate's own constructor into the same config."""

from __future__ import annotations

import pytest
from accelerate import ParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig, TorchContextParallelConfig, TorchTensorParallelConfig

from hf_longctx.errors import NotSupported
from hf_longctx.integrations.parallelism_config import launcher_parallelism_config, map_parallelism_config, ulysses_for

LLAMA_8B = (32, 8)  # query heads, KV heads


def degrees(pc, world, heads=LLAMA_8B, rpn=8, **kw):
    m = map_parallelism_config(pc, world_size=world, heads=heads, ranks_per_node=rpn, **kw)
    return m.ulysses, m.ring, m.dp


def refused(pc, world=8, heads=LLAMA_8B, **kw) -> str:
    with pytest.raises(NotSupported) as info:
        map_parallelism_config(pc, world_size=world, heads=heads, ranks_per_node=8, **kw)
    return str(info.value)


# ---- honoured: the degrees ---------------------------------------------------------------------------
def test_sp_size_is_ulysses_inside_a_node_and_ring_across():
    assert degrees(ParallelismConfig(sp_size=8), 8) == (8, 1, 1)  # one node: pure Ulysses
    assert degrees(ParallelismConfig(sp_size=16), 16) == (8, 2, 1)  # two nodes: Ulysses 8 x ring 2 over nodes
    assert degrees(ParallelismConfig(sp_size=8), 16) == (8, 1, 2)  # the rest is data parallel
    assert degrees(ParallelismConfig(sp_size=4), 4, rpn=2) == (2, 2, 1)  # 2 ranks per node
    assert degrees(ParallelismConfig(sp_size=8), 8, heads=(12, 12)) == (4, 2, 1)  # 4 = largest power of two | 12


def test_ulysses_respects_the_kv_heads():
    # 12 query heads over 3 KV heads: neither U=4 (3 heads per rank, groups of 4) nor U=2 splits the
    # KV groups, so the rule keeps Ulysses at 1 and rings the whole group.
    assert ulysses_for(8, 12, 3, 8) == 1
    assert degrees(ParallelismConfig(sp_size=8), 8, heads=(12, 3)) == (1, 8, 1)
    assert ulysses_for(8, 32, 8, 8) == 8 and ulysses_for(8, 4, 1, 8) == 4  # MQA: the KV head is replicated


def test_cp_size_is_a_ring():
    assert degrees(ParallelismConfig(cp_size=4), 8) == (1, 4, 2)
    assert degrees(ParallelismConfig(cp_size=4, dp_shard_size=2), 8) == (1, 4, 2)


def test_dp_shard_size_is_the_rest():
    assert degrees(ParallelismConfig(sp_size=4, dp_shard_size=4), 16) == (4, 1, 4)
    assert degrees(ParallelismConfig(sp_size=4, dp_shard_size=1), 16) == (4, 1, 4)  # 1: "whatever is left"
    assert degrees(ParallelismConfig(dp_shard_size=8), 8) == (1, 1, 8)  # no SP: FSDP over all 8


def test_our_degrees_override_the_split():
    assert degrees(ParallelismConfig(sp_size=8), 8, ulysses_degree=2) == (2, 4, 1)
    assert degrees(ParallelismConfig(sp_size=8), 8, ring_degree=8) == (1, 8, 1)
    assert degrees(ParallelismConfig(cp_size=4), 4, ulysses_degree=2, ring_degree=2) == (2, 2, 1)  # USP for a CP user
    assert degrees(ParallelismConfig(sp_size=8), 8, heads=None, ulysses_degree=4) == (4, 2, 1)  # no heads needed


def test_sp_handler_fields():
    h = DeepSpeedSequenceParallelConfig(sp_seq_length=4096, sp_seq_length_is_variable=False,
                                        sp_attn_implementation="flash_attention_2")
    m = map_parallelism_config(ParallelismConfig(sp_size=4, sp_handler=h), world_size=4, heads=LLAMA_8B, ranks_per_node=4)
    assert m.seq_length == 4096  # the trainers' max_tokens
    said = m.describe()
    for text in ("sp_backend='deepspeed'", "DeepSpeed is not used", "sp_seq_length=4096", "max_tokens",
                 "sp_seq_length_is_variable=False", "sp_attn_implementation='flash_attention_2'",
                 "ulysses 4 x ring 1 x dp 1", "ParallelismConfig(sp_size=4, sp_backend='deepspeed')"):
        assert text in said, (text, said)
    default = map_parallelism_config(ParallelismConfig(sp_size=4), world_size=4, heads=LLAMA_8B, ranks_per_node=4)
    assert default.seq_length is None and "sp_seq_length" not in default.describe()


def test_cp_handler_fields():
    for strategy in ("allgather", "alltoall"):
        pc = ParallelismConfig(cp_size=2, cp_handler=TorchContextParallelConfig(cp_comm_strategy=strategy))
        said = map_parallelism_config(pc, world_size=2, ranks_per_node=2).describe()
        assert f"cp_comm_strategy={strategy!r}" in said and "cp_backend='torch'" in said and "ring" in said


# ---- refused: the message names the field, the value and what to do -------------------------------------
@pytest.mark.parametrize("pc,world,needles", [
    (ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, sp_size=2), 8,
     ["dp_replicate_size=2", "HSDP", "do instead: dp_replicate_size=1"]),
    (ParallelismConfig(tp_size=2, dp_shard_size=4), 8, ["tp_size=2", "do instead: tp_size=1"]),
    (ParallelismConfig(sp_size=3), 8, ["sp_size(3) does not divide world size 8",
                                        "do instead: launch a multiple of 3 processes, or sp_size=1, 2, 4 or 8"]),
    (ParallelismConfig(cp_size=4, dp_shard_size=4), 8, ["cp_size(4) × dp_shard_size(4) = 16 ≠ world size 8",
                                                        "do instead: dp_shard_size=2 (8 / cp_size(4)) or 1",
                                                        "or launch 16 processes"]),
    (ParallelismConfig(tp_handler=TorchTensorParallelConfig()), 8, ["tp_handler=TorchTensorParallelConfig", "drop tp_handler"]),
    (ParallelismConfig(cp_handler=TorchContextParallelConfig()), 8, ["cp_handler=TorchContextParallelConfig", "drop cp_handler"]),
    (ParallelismConfig(sp_handler=DeepSpeedSequenceParallelConfig()), 8, ["sp_handler=DeepSpeedSequenceParallelConfig",
                                                                          "drop sp_handler"]),
], ids=["dp_replicate", "tp_size", "sp_not_dividing", "dp_shard", "tp_handler", "cp_handler", "sp_handler"])
def test_refused_fields(pc, world, needles):
    text = refused(pc, world)
    for needle in needles:
        assert needle in text, (needle, text)


def test_cp_and_sp_together_refused():
    pc = ParallelismConfig(sp_size=2)
    pc.cp_size = 2  # Accelerate refuses both at construction; a config changed afterwards is refused here
    assert "cp_size=2 and sp_size=2" in refused(pc, 8)


def test_bad_overrides_and_missing_heads_refused():
    text = refused(ParallelismConfig(sp_size=8), ulysses_degree=2, ring_degree=2)
    assert "ulysses_degree(2) × ring_degree(2) = 4 ≠ sp_size(8)" in text and "product is 8" in text
    for kw, said in (({"ulysses_degree": 3}, "ulysses_degree(3) does not divide sp_size(8)"),
                     ({"ring_degree": 3}, "ring_degree(3) does not divide sp_size(8)")):
        text = refused(ParallelismConfig(sp_size=8), **kw)
        assert said in text and "do instead: a divisor of sp_size(8): 1, 2, 4 or 8" in text and "None" not in text, text
    text = refused(ParallelismConfig(dp_shard_size=8), ulysses_degree=2)
    assert "ulysses_degree(2) needs an SP group" in text and "sets neither sp_size nor cp_size" in text, text
    assert "ulysses_degree=0" in refused(ParallelismConfig(sp_size=8), ulysses_degree=0)
    assert "model_config=" in refused(ParallelismConfig(sp_size=8), heads=None)


@pytest.mark.parametrize("pc,world,factors,fix", [
    # dp_shard_size counts ranks beyond the SP group: sp_size=2, dp_shard_size=2 is a world of 4, not 2
    (ParallelismConfig(sp_size=2, dp_shard_size=2), 2, "sp_size(2) × dp_shard_size(2) = 4 ≠ world size 2",
     "do instead: dp_shard_size=1 (the SP group of 2 is the whole world: no data parallelism), or launch 4 processes"),
    (ParallelismConfig(sp_size=3, dp_shard_size=2), 8, "sp_size(3) × dp_shard_size(2) = 6 ≠ world size 8",
     "do instead: launch 6 processes, or sizes whose product is 8"),
    (ParallelismConfig(sp_size=4), 2, "sp_size(4) does not divide world size 2",
     "do instead: launch a multiple of 4 processes, or sp_size=1 or 2"),
    (ParallelismConfig(dp_shard_size=4), 8, "dp_shard_size(4) ≠ world size 8",
     "do instead: dp_shard_size=8 or 1, or launch 4 processes"),
], ids=["sp2_dp2_on_2", "sp3_dp2_on_8", "sp4_on_2", "dp4_on_8"])
def test_world_size_refusal_names_every_factor_and_the_fix(pc, world, factors, fix):
    text = refused(pc, world)
    assert factors in text and fix in text, text
    assert "(or 1:" not in text and "rank(s)" not in text, text  # one fix per line, no doubled alternatives


def test_every_refusal_at_once_and_wrong_types():
    text = refused(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2), 8)
    assert "dp_replicate_size=2" in text and "tp_size=2" in text
    with pytest.raises(TypeError, match="accelerate.ParallelismConfig"):
        map_parallelism_config({"sp_size": 2}, world_size=2)


# ---- the launcher's path: what `accelerate launch` exports, read by Accelerate's own constructor -----------
def test_launcher_variables_are_read_like_the_accelerator_reads_them(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG", raising=False)
    assert launcher_parallelism_config() is None
    for key, value in {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "8",
                       "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_SP_SEQ_LENGTH": "None",
                       "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION": "sdpa"}.items():
        monkeypatch.setenv(key, value)
    pc = launcher_parallelism_config()
    assert (pc.sp_size, pc.dp_shard_size, pc.sp_backend) == (8, 2, "deepspeed")
    assert degrees(pc, 16) == (8, 1, 2)
