"""recipes/shared_files.py on 4 gloo ranks laid out as 2 nodes of 2 (LOCAL_RANK = rank % 2).

Each rank works in its node's directory, so a directory "shared by every node" and "local to each
node" are both one test away: `build_once` with one directory for all returns on every rank with
rank 0's files readable; with one directory per node, or with an older build on node 1, every
rank stops with the same message (the path rank 0 built in, the ranks that do not see it, the
fix) instead of a FileNotFoundError on one node; a build that raises on rank 0 ends every rank,
not in a hang. `fill_caches_in_turn` runs rank 0 alone, then the first rank of node 1, then the
others. The pool's task timeout bounds every case.
"""

from __future__ import annotations

import json
import os
import time

import pytest

FIX = "pass a shared --output-dir"


def _on_node(node_dirs: list[str], fn, *args):
    """Run fn(*args) in this rank's node directory, as LOCAL_RANK rank % 2; cwd and env restored."""
    import torch.distributed as dist

    rank, cwd, local = dist.get_rank(), os.getcwd(), os.environ.get("LOCAL_RANK")
    os.chdir(node_dirs[rank // 2])
    os.environ["LOCAL_RANK"] = str(rank % 2)
    try:
        return fn(*args)
    finally:
        os.chdir(cwd)
        if local is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = local


def _build(fail: bool) -> tuple[str, str | None]:
    """("ok", what this rank reads of rank 0's file) or ("exit", SystemExit's message) or (the
    exception's type, its message)."""
    from tests.helpers.recipe_launch import recipe_modules

    (shared,) = recipe_modules("shared_files")

    def build():
        if fail:
            raise ValueError("no disk space")
        os.makedirs("out", exist_ok=True)
        with open(os.path.join("out", "weights.txt"), "w") as f:
            f.write("built by rank 0")

    try:
        shared.build_once("out", build, what="the test model", fix=FIX)
    except SystemExit as e:
        return "exit", str(e)
    except Exception as e:
        return type(e).__name__, str(e)
    with open(os.path.join("out", "weights.txt")) as f:
        return "ok", f.read()


def _build_on_nodes(node_dirs: list[str], fail: bool = False):
    return _on_node(node_dirs, _build, fail)


def _in_turn(log: str) -> list[int]:
    """The ranks this rank finds in `log` when it enters the block (then it adds itself)."""
    from tests.helpers.recipe_launch import recipe_modules

    (shared,) = recipe_modules("shared_files")
    with shared.fill_caches_in_turn():
        with open(log) as f:
            before = [int(x) for x in f.read().split()]
        time.sleep(0.2)  # a rank let in too early would find this one missing
        import torch.distributed as dist

        with open(log, "a") as f:
            f.write(f"{dist.get_rank()}\n")
    return before


def _in_turn_on_nodes(node_dirs: list[str], log: str):
    return _on_node(node_dirs, _in_turn, log)


def test_one_shared_directory_is_built_once_and_read_by_every_rank(pools, tmp_path):
    got = pools.get(4).run(_build_on_nodes, [str(tmp_path)] * 2)
    assert got == [("ok", "built by rank 0")] * 4, got
    assert json.loads((tmp_path / "out" / "build_stamp.json").read_text())["what"] == "the test model"


@pytest.mark.parametrize("older", [False, True], ids=["missing", "older-build"])
def test_a_node_local_directory_stops_every_rank_with_the_fix(pools, tmp_path, older):
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for d in nodes:
        d.mkdir()
    if older:  # node 1's disk holds the build of an earlier job
        (nodes[1] / "out").mkdir()
        (nodes[1] / "out" / "build_stamp.json").write_text(json.dumps({"token": "earlier", "what": "the test model"}))
    got = pools.get(4).run(_build_on_nodes, [str(d) for d in nodes])
    kinds, messages = {k for k, _ in got}, {m for _, m in got}
    assert kinds == {"exit"} and len(messages) == 1, got  # every rank, the same words
    (message,) = messages
    assert f"the test model that rank 0 built in {nodes[0] / 'out'}" in message, message
    assert "is not there for rank(s) 2, 3" in message and message.endswith(f"Fix: {FIX}"), message
    assert ("(it holds an older build)" in message) == older, message


def test_a_failed_build_ends_every_rank(pools, tmp_path):
    got = pools.get(4).run(_build_on_nodes, [str(tmp_path)] * 2, True)
    assert got[0] == ("ValueError", "no disk space"), got
    assert got[1:] == [("exit", "rank 0 failed to build the test model in out: ValueError: no disk space")] * 3, got


def test_caches_fill_rank_zero_then_one_rank_per_node_then_the_rest(pools, tmp_path):
    log = tmp_path / "entered.txt"
    log.write_text("")
    got = pools.get(4).run(_in_turn_on_nodes, [str(tmp_path)] * 2, str(log))
    assert got[0] == [] and got[2] == [0], got  # rank 0 alone, then node 1's first rank
    assert sorted(got[1][:2]) == [0, 2] and sorted(got[3][:2]) == [0, 2], got  # then the others
