"""Accelerate's `ParallelismConfig` read as the hf_longctx mesh: each field honoured, answered or refused.

Where it sits: at the start of a job, before the mesh exists. `mesh_from_parallelism_config`
(your own loop) and the trainers (`training/base/mesh_source.py`) turn what a user of ALST
(`sp_size`, `sp_backend="deepspeed"`) or of Accelerate's context parallelism (`cp_size`) wrote --
in `TrainingArguments(parallelism_config=...)`, or in an accelerate YAML that the launcher passes
on as PARALLELISM_CONFIG_* variables -- into the degrees of `init_sequence_parallel`.
The rule (USP §4): the SP degree is `sp_size` (ALST's Ulysses) or `cp_size` (Accelerate's ring
attention). For `sp_size`, Ulysses U is the largest power of two that divides the SP degree, the
query heads and the ranks of one node, and that the KV heads split over (`ops/ulysses.kv_replication`);
the ring is R = SP / U: Ulysses inside a node, the ring across nodes. `cp_size` becomes a ring of
that size. dp = world / SP (`dp_shard_size` must equal it, or stay 1); FSDP2 shards over the world.
`ulysses_degree` / `ring_degree` replace the rule's split. Pure and the same on every rank: every
refused field is named, with its value and what to do, in one `NotSupported` before any collective."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

from hf_longctx.distributed.mesh import SPMesh, init_sequence_parallel, process_group_world
from hf_longctx.errors import NotSupported
from hf_longctx.ops.ulysses import kv_replication
from hf_longctx.sp_groups import default_ranks_per_node

ENV_FLAG = "ACCELERATE_USE_PARALLELISM_CONFIG"  # `accelerate launch` sets it with the PARALLELISM_CONFIG_* values
SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")


@dataclass(frozen=True)
class ParallelismMap:
    """The mesh a `ParallelismConfig` maps to: the degrees, the micro-batch cap its `sp_seq_length`
    gives (None: not set) and one note per field that hf_longctx answers with its own mechanism."""

    ulysses: int
    ring: int
    dp: int
    seq_length: int | None
    written: str
    notes: tuple[str, ...]

    @property
    def sp(self) -> int:
        """The SP degree: ulysses x ring."""
        return self.ulysses * self.ring

    def describe(self) -> str:
        """What a job says once: the config as written, the mesh it became, and each note."""
        head = (f"{self.written} -> hf_longctx mesh: ulysses {self.ulysses} x ring {self.ring} x dp {self.dp}, "
                f"FSDP2 over all {self.dp * self.sp} ranks")
        return "\n".join([head, *(f"  - {n}" for n in self.notes)])


def written(pc: Any) -> str:
    """The config as a user reads it: the sizes above 1 and the backend of the SP kind in use."""
    parts = [f"{name}={getattr(pc, name)}" for name in SIZES if getattr(pc, name, 1) != 1]
    if getattr(pc, "sp_size", 1) > 1:
        parts.append(f"sp_backend={pc.sp_backend!r}")
    if getattr(pc, "cp_size", 1) > 1:
        parts.append(f"cp_backend={pc.cp_backend!r}")
    return f"ParallelismConfig({', '.join(parts)})"


def model_heads(model_config: Any) -> tuple[int, int]:
    """(query heads, KV heads) of a transformers config (its text config for a multimodal one)."""
    from hf_longctx.data.model_dims import ModelDims

    dims = ModelDims.from_config(model_config)
    return dims.heads, dims.kv_heads


def ulysses_for(sp: int, heads: int, kv_heads: int, ranks_per_node: int) -> int:
    """The rule's Ulysses degree of an SP group of `sp` ranks (see the module docstring)."""
    u = 1
    while sp % (2 * u) == 0 and heads % (2 * u) == 0 and ranks_per_node % (2 * u) == 0:
        u *= 2
    while u > 1:
        try:
            kv_replication(heads, kv_heads, u)
            return u
        except ValueError:
            u //= 2
    return 1


def _handler_notes(pc: Any, errors: list[str]) -> tuple[list[str], int | None]:
    """The handlers' fields: honoured or answered (notes), or refused (errors); the micro-batch cap."""
    notes, seq = [], None
    for kind, size in (("tp", pc.tp_size), ("cp", pc.cp_size), ("sp", pc.sp_size)):
        handler = getattr(pc, f"{kind}_handler", None)
        if handler is not None and size == 1:
            errors.append(f"{kind}_handler={type(handler).__name__}(...) with {kind}_size=1: it configures a "
                          f"parallelism this config does not use; do instead: drop {kind}_handler")
    if pc.cp_size > 1:
        notes.append(f"cp_backend={pc.cp_backend!r} (torch's context_parallel over SDPA) runs as hf_longctx's ring "
                     "attention: zigzag-balanced, documents packed without padding, exact")
        strategy = getattr(pc.cp_handler, "cp_comm_strategy", None)
        if strategy is not None:
            notes.append(f"cp_comm_strategy={strategy!r}: the K/V exchange is hf_longctx's ring (each rank passes its "
                         "K/V block to the next, overlapped with the attention of the current one); same result")
    if pc.sp_size > 1:
        notes.append(f"sp_backend={pc.sp_backend!r} (ALST's DeepSpeed Ulysses) runs as hf_longctx's Ulysses x ring "
                     "attention with FSDP2 over the world; DeepSpeed is not used")
        h = pc.sp_handler
        if h is not None:
            seq = h.sp_seq_length
            if seq is not None:
                notes.append(f"sp_seq_length={seq}: the trainers' micro-batch cap max_tokens (tokens of one packed "
                             "micro-batch of an SP group); your own loop packs to its own cap")
            if not h.sp_seq_length_is_variable:
                notes.append("sp_seq_length_is_variable=False: micro-batches are packed up to the cap and may be "
                             "shorter; exactness does not depend on it")
            if h.sp_attn_implementation is not None:
                notes.append(f"sp_attn_implementation={h.sp_attn_implementation!r}: the local attention kernel is "
                             "hf_longctx's own, chosen per device (flash kernels on CUDA when installed)")
    return notes, seq


def _sp_name(pc: Any, sp: int) -> str:
    """The SP degree as the config wrote it: `sp_size(8)`, `cp_size(4)`, or `the SP degree 1` without either."""
    if pc.sp_size > 1:
        return f"sp_size({sp})"
    return f"cp_size({sp})" if pc.cp_size > 1 else f"the SP degree {sp} (neither sp_size nor cp_size set)"


def _alternatives(values: list[int]) -> str:
    """1, 2, 4 or 8."""
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} or {text[-1]}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _world_errors(pc: Any, sp: int, world_size: int, errors: list[str]) -> int:
    """The data-parallel degree world / SP, or 0 (refused) when the SP degree and `dp_shard_size`
    do not make the world; each refusal names every factor, the world size and the fix."""
    field, d = ("sp_size" if pc.sp_size > 1 else "cp_size"), pc.dp_shard_size
    if world_size % sp:
        if d == 1:
            errors.append(f"{field}({sp}) does not divide world size {world_size}; do instead: launch a multiple of "
                          f"{sp} processes, or {field}={_alternatives(_divisors(world_size))}")
        else:
            errors.append(f"{field}({sp}) × dp_shard_size({d}) = {sp * d} ≠ world size {world_size}; do instead: "
                          f"launch {sp * d} processes, or sizes whose product is {world_size}")
        return 0
    dp = world_size // sp
    if d in (1, dp):  # 1: the data-parallel degree is whatever the SP group leaves
        return dp
    if sp == 1:
        errors.append(f"dp_shard_size({d}) ≠ world size {world_size}; do instead: dp_shard_size={world_size} or 1, "
                      f"or launch {d} processes")
    elif dp == 1:
        errors.append(f"{field}({sp}) × dp_shard_size({d}) = {sp * d} ≠ world size {world_size}; do instead: "
                      f"dp_shard_size=1 (the SP group of {sp} is the whole world: no data parallelism), or launch "
                      f"{sp * d} processes")
    else:
        errors.append(f"{field}({sp}) × dp_shard_size({d}) = {sp * d} ≠ world size {world_size}; do instead: "
                      f"dp_shard_size={dp} ({world_size} / {field}({sp})) or 1 (whatever the SP group leaves), or "
                      f"launch {sp * d} processes")
    return 0


def _split(pc: Any, sp: int, heads: Any, ranks_per_node: int, ulysses_degree: Any, ring_degree: Any,
           errors: list[str]) -> tuple[int, int]:
    """(U, R): the override when given (checked against the SP degree), else the rule."""
    for name, value in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            errors.append(f"{name}={value!r}: must be a positive int; do instead: pass a positive int or leave it out")
            return 1, sp
    if ulysses_degree is not None and ring_degree is not None:
        if ulysses_degree * ring_degree != sp:
            errors.append(f"ulysses_degree({ulysses_degree}) × ring_degree({ring_degree}) = "
                          f"{ulysses_degree * ring_degree} ≠ {_sp_name(pc, sp)}, as {written(pc)} asks; do instead: "
                          f"degrees whose product is {sp}, or leave them out (the rule picks them)")
        return ulysses_degree, ring_degree
    for name, value in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
        if value is not None:  # one degree given: the other is what it leaves of the SP group
            if sp == 1 and value > 1:
                errors.append(f"{name}({value}) needs an SP group, but {written(pc)} sets neither sp_size nor cp_size; "
                              f"do instead: sp_size=<a multiple of {value}>, or leave {name} out")
                return 1, sp
            if sp % value:
                errors.append(f"{name}({value}) does not divide {_sp_name(pc, sp)}, as {written(pc)} asks; do instead: "
                              f"a divisor of {_sp_name(pc, sp)}: {_alternatives(_divisors(sp))}, or leave it out "
                              "(the rule picks it)")
                return 1, sp
            return (value, sp // value) if name == "ulysses_degree" else (sp // value, value)
    if pc.sp_size == 1:  # cp_size (or no SP): Accelerate's context parallelism is ring attention
        return 1, sp
    if heads is None:
        errors.append(f"sp_size={pc.sp_size}: the Ulysses degree is bounded by the model's heads, which were not given; "
                      "do instead: pass model_config= (model.config), or ulysses_degree= / ring_degree=")
        return 1, sp
    u = ulysses_for(sp, heads[0], heads[1], ranks_per_node)
    return u, sp // u


def map_parallelism_config(pc: Any, *, world_size: int, heads: tuple[int, int] | None = None,
                           ranks_per_node: int | None = None, ulysses_degree: int | None = None,
                           ring_degree: int | None = None) -> ParallelismMap:
    """The mesh `pc` (an `accelerate.ParallelismConfig`) maps to on `world_size` ranks. `heads`:
    (query heads, KV heads) of the model, needed for the rule's Ulysses degree; `ranks_per_node`:
    default `sp_groups.default_ranks_per_node`. Raises one `NotSupported` naming every refused field."""
    from accelerate import ParallelismConfig

    if not isinstance(pc, ParallelismConfig):
        raise TypeError(f"parallelism_config must be an accelerate.ParallelismConfig, got {type(pc).__name__}")
    bad = [f"{n}={getattr(pc, n)!r}" for n in SIZES if isinstance(getattr(pc, n), bool)
           or not isinstance(getattr(pc, n), int) or getattr(pc, n) < 1]
    if bad:
        raise ValueError(f"ParallelismConfig sizes must be positive ints: {', '.join(bad)}")
    errors: list[str] = []
    if pc.dp_replicate_size > 1:
        errors.append(f"dp_replicate_size={pc.dp_replicate_size}: replicated data-parallel groups (HSDP) are not "
                      "implemented; hf_longctx shards parameters, gradients and optimizer states over the whole world "
                      "(ZeRO-3); do instead: dp_replicate_size=1 (the data-parallel degree is world / SP: dp_shard_size)")
    if pc.tp_size > 1:
        errors.append(f"tp_size={pc.tp_size}: tensor parallelism is not part of the hf_longctx mesh; do instead: tp_size=1 "
                      "and give those ranks to sp_size (Ulysses splits the attention heads over ranks, as TP does)")
    if pc.cp_size > 1 and pc.sp_size > 1:
        errors.append(f"cp_size={pc.cp_size} and sp_size={pc.sp_size}: one SP degree; do instead: sp_size alone "
                      "(Ulysses x ring by the rule, or ulysses_degree= / ring_degree=)")
    notes, seq = _handler_notes(pc, errors)
    sp = pc.sp_size if pc.sp_size > 1 else pc.cp_size
    dp = _world_errors(pc, sp, world_size, errors)
    rpn = default_ranks_per_node(world_size) if ranks_per_node is None else ranks_per_node
    u, r = _split(pc, sp, heads, rpn, ulysses_degree, ring_degree, errors)
    if errors:
        raise NotSupported(f"{written(pc)} cannot be mapped onto the hf_longctx mesh:\n- " + "\n- ".join(errors),
                           "change the fields listed above as each line says")
    return ParallelismMap(ulysses=u, ring=r, dp=dp, seq_length=seq, written=written(pc), notes=tuple(notes))


def launcher_parallelism_config() -> Any:
    """The `ParallelismConfig` an accelerate launch exported (ACCELERATE_USE_PARALLELISM_CONFIG=true
    and PARALLELISM_CONFIG_*, from a YAML's `parallelism_config:` or --parallelism_config_* flags),
    read by Accelerate's own constructor as its `Accelerator` would; None without one."""
    if os.environ.get(ENV_FLAG, "false").lower() != "true":
        return None
    from accelerate import ParallelismConfig

    return ParallelismConfig()


def launcher_ranks_per_node(world_size: int) -> int:
    """Ranks on this node: the launcher's LOCAL_WORLD_SIZE (torchrun sets it), else the
    `default_ranks_per_node` of the group bank."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else default_ranks_per_node(world_size)


def mesh_from_parallelism_config(pc: Any, model_config: Any = None, *, ulysses_degree: int | None = None,
                                 ring_degree: int | None = None, ranks_per_node: int | None = None,
                                 fpdt_chunks: int = 1) -> SPMesh:
    """`init_sequence_parallel` with the degrees an `accelerate.ParallelismConfig` maps to (the
    rule in this module's docstring): `sp_size` -> Ulysses x ring (Ulysses as wide as the heads
    of `model_config` and one node allow, the ring over the rest), `cp_size` -> ring,
    `dp_shard_size` -> the data-parallel rest. Call it on every rank after the process group
    exists. The fields answered by hf_longctx's own mechanism are said once (a warning on
    rank 0).

    Args:
        pc: The `accelerate.ParallelismConfig`.
        model_config: The model's config (its heads bound the Ulysses degree).
        ulysses_degree: Replaces the split's Ulysses degree.
        ring_degree: Replaces the split's ring degree.
        ranks_per_node: GPUs per node (default: LOCAL_WORLD_SIZE, else the local GPU count).
        fpdt_chunks: As for `init_sequence_parallel`.

    Returns:
        This rank's mesh.

    Raises:
        NotSupported: Naming each refused field of `pc`.
    """
    _, world = process_group_world("mesh_from_parallelism_config")
    heads = model_heads(model_config) if model_config is not None else None
    mapped = map_parallelism_config(
        pc, world_size=world, heads=heads, ulysses_degree=ulysses_degree, ring_degree=ring_degree,
        ranks_per_node=launcher_ranks_per_node(world) if ranks_per_node is None else ranks_per_node)
    mesh = init_sequence_parallel(mapped.ulysses, mapped.ring, fpdt_chunks)
    if mapped.notes and mesh.rank == 0:
        warnings.warn(f"mesh_from_parallelism_config: {mapped.describe()}", stacklevel=2)
    return mesh
