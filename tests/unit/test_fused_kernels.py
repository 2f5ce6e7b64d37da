"""patch(fused=True) launches fewer kernels, as many fewer as the step-time inventory says.

Counted on CPU by benchmarks/_launches.py (torch.profiler with inductor's kernel records: aten
ops that run a kernel, and generated kernels) over one bf16 fwd+bwd step of the tiny Llama of
benchmarks/hot_path.py (hidden 64, 64 tokens), rank 0 of a one-rank fake process group, under
"off", the "balanced" knobs and the "max" knobs with 3 row chunks (benchmarks/fused.py prints
the table). Per decoder layer (4-layer − 2-layer) / 2:
- the eager ops of the fused regions are gone (RMSNorm's pow / rsqrt / mean, RoPE's neg, SiLU
  and its backward) while inductor's kernels run in their place;
- eager − fused launches equal the inventory's (`capacity/inventory.py` with `fused`), per
  layer and for the whole step (the loss's tail and the final norm included): the model's
  accounting of the fused ops is the count of what runs;
- the fault: the same fused patch with `torch.compile` a no-op (returning the function it is
  given) runs its regions eagerly and launches exactly the eager count, so a fusion that
  silently did nothing fails the checks above.
"""

from __future__ import annotations

import dataclasses

import pytest

EAGER_ONLY = ("pow", "rsqrt", "mean", "neg", "silu", "silu_backward")
SETTINGS = {
    "off": ({}, {}),
    "balanced knobs": ({"mlp_chunks": 3, "loss_chunks": 3}, {"mlp_chunks": 3, "loss_chunk": 22}),
    "max knobs": ({"checkpoint": True, "mlp_chunks": 3, "loss_chunks": 3},
                  {"checkpoint": True, "mlp_chunks": 3, "loss_chunk": 22}),
}
DIMS = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=96)  # benchmarks/hot_path.py's Llama


@pytest.fixture(scope="module")
def mesh():
    import torch.distributed as dist

    from benchmarks._op_stream import fake_world
    from benchmarks.fused import one_rank_mesh

    if dist.is_initialized():
        pytest.fail("a default process group is already up in this process; the count needs its own fake one")
    with fake_world(1):
        yield one_rank_mesh()


def _launches(ops) -> float:
    from hf_longctx.capacity.op_cost import Tally

    return sum(Tally.of(ops).launches.values())


def _modelled_difference(knobs: dict, per_layer: bool) -> float:
    from hf_longctx.capacity.inventory import Shape, layer_ops, step_inventory

    shape = Shape(**DIMS, rows=64, docs=(20, 12, 24, 8), **knobs)
    of = (lambda s: layer_ops(s)) if per_layer else (lambda s: step_inventory(s, 2))
    return _launches(of(shape)) - _launches(of(dataclasses.replace(shape, fused=True)))


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_fused_regions_launch_what_the_inventory_says(mesh, setting):
    from benchmarks.fused import layer_counts

    options, knobs = SETTINGS[setting]
    (eager, eager_step), (fused, fused_step) = (layer_counts(mesh, options, f) for f in (False, True))
    assert all(eager[n] > 0 and fused[n] == 0 for n in EAGER_ONLY), {n: (eager[n], fused[n]) for n in EAGER_ONLY}
    assert sum(v for k, v in fused.items() if k.startswith("inductor:")) > 0, fused
    gone = sum(eager.values()) - sum(fused.values())
    assert gone == _modelled_difference(knobs, per_layer=True), (gone, sorted((fused - eager).items()))
    gone_step = sum(eager_step.values()) - sum(fused_step.values())
    assert gone_step == _modelled_difference(knobs, per_layer=False), gone_step


def test_fusion_turned_off_launches_the_eager_count(mesh, monkeypatch):
    """The fault the checks above catch: fused=True whose compile does nothing."""
    import torch

    from benchmarks.fused import layer_counts

    options, _ = SETTINGS["max knobs"]
    eager, _ = layer_counts(mesh, options, False)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    broken, _ = layer_counts(mesh, options, True)
    assert sum(broken.values()) == sum(eager.values()) and all(broken[n] > 0 for n in EAGER_ONLY), broken
