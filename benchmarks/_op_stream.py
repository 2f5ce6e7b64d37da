"""The op stream of a real patched training step on the CUDA dispatch path, recorded on CPU.

Where it sits: the measured side of the step-time model (`hf_longctx/capacity/roofline.py`);
`benchmarks/gpu_model.py` and tests/unit/test_step_model.py compare it with the closed-form
inventory (`hf_longctx/capacity/inventory.py`). It extends `benchmarks/_counting.Counter` (what
runs on the device, by provenance) to keep every counted call as a `capacity/op_cost.Op`:

- a kernel-like aten op: FLOPs from `torch.utils.flop_counter`'s formulas (GEMMs; 0 for
  elementwise ops), HBM bytes = every tensor operand read plus every result written (a
  broadcast operand counts its distinct elements; `copy_` does not read its destination);
- a local attention kernel call (the emulated flash-attn 2.8 kernel, `_stubs.CountedKernel`):
  (query, key) pairs from its cumulative lengths and mask (`op_cost.attention_pairs`), FLOPs
  4·pairs·D per head forward and 10·pairs·D backward (FlashAttention-2: 2 and 5 matmuls);
- a collective: the bytes this rank sends on the group's link (all-to-all (n-1)/n of its
  buffer, a ring send all of it);
- a host<->device copy: its bytes on PCIe, on the side stream when issued inside
  `Streams.on(...)` (the offload copies of `ops/offload.py`), else on the compute stream.

Run `record(config, mesh, options, layers)` in one process: rank 0 of an N-rank mesh on
torch's fake process group (no data moves; shapes and control flow are rank 0's)."""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._counting import Counter  # noqa: E402
from benchmarks._stubs import StubStreams  # noqa: E402
from hf_longctx.capacity.op_cost import (  # noqa: E402
    ATTN_BWD, ATTN_FWD, COLLECTIVE, D2H, ELEMENTWISE, GEMM, H2D, P2P, Op, attention_pairs,
)

GEMMS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm", "convolution", "linear"}
ALIASES = {"_unsafe_view", "alias", "_reshape_alias"}  # not views by schema, but no kernel on CUDA either


def touched(t: torch.Tensor) -> int:
    """Bytes of the distinct elements of `t` (a broadcast dim, stride 0, counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else 1
    return n * t.element_size() if t.numel() else 0


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


class OpStream(Counter):
    """A `Counter` that keeps the op stream of the counted step in `ops`. `link_of(group)`
    names the link of a process group ("ulysses", "ring", ...)."""

    def __init__(self, link_of=lambda group: "world") -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.side = 0  # > 0 inside Streams.on(side stream)
        self.link_of = link_of
        self.shapes: list[str] = []  # per op: its operands' shapes and dtypes (reading a stream by eye)

    def reset(self) -> None:
        super().reset()
        self.ops.clear()
        self.shapes.clear()

    def record(self, what, func, args, kwargs, out) -> None:
        self.paused += 1  # reading operands is not part of the step
        try:
            op = {"kernels": self._kernel, "collectives": self._collective, "h2d": self._copy, "d2h": self._copy,
                  "attention": self._attention}[what](what, func, args, kwargs, out)
        finally:
            self.paused -= 1
        if op is not None:
            self.ops.append(op)
            self.shapes.append(" ".join(f"{tuple(t.shape)}{str(t.dtype)[6:]}" for t in _tensors((args, kwargs, out))
                                        if isinstance(t, torch.Tensor)))

    def _kernel(self, what, func, args, kwargs, out) -> Op | None:
        name = func._schema.name.split("::")[-1]
        if name in ALIASES:
            return None
        reads = _tensors((args[1:], kwargs)) if name == "copy_" else _tensors((args, kwargs))
        moved = sum(map(touched, reads)) + sum(map(touched, _tensors(out)))
        packet = func.overloadpacket
        flops = float(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0.0
        kind = GEMM if name in GEMMS else ELEMENTWISE
        return Op(kind, flops=flops, bytes=float(moved), what=name)

    def _collective(self, what, func, args, kwargs, out) -> Op:
        name = func._schema.name.split("::")[-1]
        group = next(a for a in tree_leaves((args, kwargs)) if hasattr(a, "size") and hasattr(a, "rank")
                     and not isinstance(a, torch.Tensor))
        n = group.size()
        tensors = _tensors(args)
        if name.startswith("alltoall"):
            sent = touched(tensors[1]) * (n - 1) / n  # (output, input, ...)
            return Op(COLLECTIVE, bytes=2.0 * touched(tensors[1]), link=self.link_of(group), wire=sent, what=name)
        if name == "send":
            sent = sum(map(touched, tensors))
            return Op(P2P, bytes=float(sent), link=self.link_of(group), wire=float(sent), what=name)
        if name.startswith("recv"):
            return None  # the sender's op carries the bytes on the wire
        raise NotImplementedError(f"the op stream does not model collective {name} yet")

    def _copy(self, what, func, args, kwargs, out) -> Op:
        src = args[1] if not isinstance(func, str) else args[0]  # copy_(dst, src) / src.to(...)
        nbytes = float(touched(src))
        return Op(H2D if what == "h2d" else D2H, bytes=nbytes, link="pcie", wire=nbytes,
                  stream="side" if self.side else "main", what=what)

    def _attention(self, what, direction, args, kwargs, out) -> Op:
        fwd = direction == "forward"
        q, k = (args[0], args[1]) if fwd else (args[1], args[2])
        cu_q, cu_k = (args[3], args[4]) if fwd else (args[6], args[7])
        cq, ck = cu_q.tolist(), cu_k.tolist()
        pairs = sum(attention_pairs(cq[i + 1] - cq[i], ck[i + 1] - ck[i], kwargs["causal"], kwargs["left"], kwargs["right"])
                    for i in range(len(cq) - 1))
        heads, d = q.shape[1], q.shape[2]
        operands = [a for a in args if isinstance(a, torch.Tensor) and a.dim() > 1]  # not the lengths
        moved = sum(map(touched, operands)) + sum(map(touched, _tensors(out)))
        flops = (4 if fwd else 10) * pairs * heads * d
        return Op(ATTN_FWD if fwd else ATTN_BWD, flops=float(flops), bytes=float(moved), what=f"flash_{direction}")


class StreamStubs(StubStreams):
    """`StubStreams` that tell the recorder when a copy runs on a side stream."""

    def on(self, stream):
        @contextlib.contextmanager
        def side():
            self.c.side += 1
            try:
                yield
            finally:
                self.c.side -= 1

        return side()


def mesh_links(mesh):
    """link_of for `mesh`'s groups: "ulysses", "ring", else "world"."""
    def ranks(g):
        import torch.distributed as dist
        return None if g is None else tuple(dist.get_process_group_ranks(g))

    names = {ranks(mesh.ulysses_group): "ulysses", ranks(mesh.ring_group): "ring"}

    def link_of(group):
        import torch.distributed as dist
        try:
            return names.get(tuple(dist.get_process_group_ranks(group)), "world")
        except (RuntimeError, ValueError):
            return "world"

    return link_of


def llama(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=96, tied=False):
    """A small Llama config (bf16 weights are made by `record`)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                       pad_token_id=0, tie_word_embeddings=tied)


def _batch(tokens: int, vocab: int, docs=None) -> dict:
    """One packed row of `tokens` random ids; `docs`: document lengths (default one document)."""
    docs = docs or [tokens]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (1, tokens), generator=g)
    pos = torch.cat([torch.arange(n) for n in docs])[None]  # [1, S] per-document positions
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def record(config, mesh, options: dict, tokens: int, docs=None, shapes: list | None = None) -> list[Op]:
    """The op stream of one fwd+bwd step of the patched bf16 model of `config` on this rank
    (after one warm-up step), `tokens` tokens in the SP group."""
    from transformers import AutoModelForCausalLM

    from benchmarks.census import emulated_offload
    from benchmarks.hot_path import _on_device, forced_cuda_path
    from hf_longctx.data.sharding import shard_batch
    from hf_longctx.integrations.model_patch import patch

    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    counter = OpStream(mesh_links(mesh))
    with emulated_offload(StreamStubs(counter)), forced_cuda_path(counter), counter.tracking():
        counter.mark_module(model)
        patch(model, mesh, **options)
        model.train()
        shard = shard_batch(_batch(tokens, config.vocab_size, docs), mesh)
        _on_device(counter, model, shard)
        model(**shard).loss.backward()  # warm-up: lazy initialisations out of the count
        model.zero_grad(set_to_none=True)
        counter.reset()
        with counter.counting():
            model(**shard).loss.backward()
    if shapes is not None:
        shapes.extend(counter.shapes)
    return list(counter.ops)


@contextlib.contextmanager
def fake_world(world: int):
    """This process as rank 0 of `world` ranks on torch's fake process group (collectives move
    nothing: shapes and control flow only)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
