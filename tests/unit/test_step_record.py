"""`trainer.last_plan` (`StepRecord`) for both kinds of plan: groups per slot, planned tokens
per group, measured time, and the JSON `hf-longctx step-plot` reads."""

from __future__ import annotations

import json

import pytest

from hf_longctx.sp_groups import group_shapes
from hf_longctx.flex.plan import FlexGroup, FlexPlan
from hf_longctx.data.packing import plan_microbatches
from hf_longctx.training.base.step_record import StepRecord


def test_flex_record_groups_tokens_and_json(tmp_path):
    shapes = group_shapes(4, heads=4)
    plan = FlexPlan(slots=((FlexGroup(4, 0, (0,)),), (FlexGroup(2, 0, (1, 2)), FlexGroup(1, 2, (3,)), FlexGroup(1, 3, ()))),
                    lengths=(60, 10, 20, 7), world_size=4, max_tokens_per_rank=32, shapes=shapes)
    rec = StepRecord(5, plan, (60, 10, 20, 7), {"synced_over_ideal": 1.1, "layouts": [(4,), (2, 1, 1)]}, (0.5, 0.25))
    assert rec.groups == ["[4]", "[2+1+1]"] and rec.measured_s == pytest.approx(0.75)
    assert rec.slot_tokens() == [[(4, 60)], [(2, 30), (1, 7), (1, 0)]]
    path = tmp_path / "step.json"
    rec.save(path)
    data = json.loads(path.read_text())
    assert data["modelled"] == {"synced_over_ideal": 1.1}  # non-scalar statistics are left out of the JSON
    assert data["slot_tokens"] == [[[4, 60]], [[2, 30], [1, 7], [1, 0]]] and data["step"] == 5


def test_fixed_record_tokens_per_dp_rank_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from hf_longctx.cli import main

    lengths = [30, 7, 12, 9, 25, 3, 14]
    plan = plan_microbatches(lengths, dp_size=2, max_tokens=32)
    rec = StepRecord(1, plan, tuple(lengths), {}, tuple(0.1 for _ in range(plan.num_microbatches)))
    assert sum(n for slot in rec.slot_tokens() for _, n in slot) == sum(lengths)
    assert all(len(slot) == 2 for slot in rec.slot_tokens())
    rec.save(tmp_path / "step.json")
    assert main(["step-plot", str(tmp_path / "step.json"), "--out", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "bad.json").write_text("{}")
    assert main(["step-plot", str(tmp_path / "bad.json"), "--out", str(tmp_path / "t.png")]) == 2


def test_fixed_degree_plot_labels_legend_and_dp1_note(tmp_path, monkeypatch):
    """The fixed-degree `--plot`: the y axis counts TFLOP (an amount, not a rate), the legend
    sits beside the axes (not over the bars), a long title is wrapped to the figure, and a
    dp-1 figure says its single bar is balanced by construction."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from hf_longctx.data.cost import CostModel
    from hf_longctx.cli import load_plot as plot

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    cost = CostModel(a=1e6, b=1e9)
    plan = plan_microbatches([300, 70, 120, 90, 250, 30, 140], dp_size=1, max_tokens=320, cost=cost)
    plot.draw_load(plan, cost, tmp_path / "f.png", "x " * 200)
    (fig,) = figs
    ax = fig.axes[0]
    assert ax.get_ylabel().startswith("step cost (TFLOP,")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert ax.get_legend().get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1
    assert ax.get_title().count("\n") >= 1
    assert all(t.get_window_extent(renderer).x1 <= fig.bbox.x1 + 1 for t in [ax.title])
    assert any("balanced by construction" in t.get_text() for t in ax.texts)
