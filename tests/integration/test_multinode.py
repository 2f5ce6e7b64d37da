"""Two nodes, launched: two `torchrun --nnodes 2 --nproc-per-node 2` agents on this machine.

Each agent is its own process (and process group), as on two hosts; they meet through a c10d
rendezvous on 127.0.0.1 at a free port (agent 0 hosts the store: `is_host`,
tests/helpers/launcher.py `run_agents`), and the 4 workers run over gloo.

Exactness (tests/helpers/multinode_worker.py): the mesh of `ParallelismConfig(sp_size=4)` with 2
ranks per node puts Ulysses inside each node and the ring across the two. Two SGD steps
on packed batches must equal the unpatched model in one process: the global loss of each step,
every gradient of the first and every parameter's change over both (-lr x the two steps'
gradients) within 1e-5 relative to the tensor's largest entry (fp32: reordered sums of ~50 token
terms move the result by ~1e-7; a lost target or an averaged reduction is off by >= 1e-2); a
change also carries the rounding of the two fp32 parameters it is the difference of (4 ulps of
the largest, ~1e-9, where the smallest changes are ~3e-5). SGD,
not Adam: Adam's first update is ~lr x sign(g), so a gradient entry of 1e-9 (below its eps)
rounded differently would move a parameter by ~lr whatever the accuracy of the step.
The mapping is said once, by rank 0.

Recipes: the guide's two-agent command (docs/guides/multi-node.md, parsed from the page, its
port a free one) trains recipes/demo.py, which builds its own tokenizer and model, and its step
lines equal those of one agent of 4 ranks with the same arguments (same ranks, mesh, data and
seed: the same arithmetic); recipes/dpo.py builds its tiny Llama and trains 2 steps with every
rank's logs finite and equal, step 1 at loss ln 2 (policy == reference). With an --output-dir
that each node resolves to its own directory (as node-local disks do), dpo.py stops on every
rank with the path and the fix instead of a FileNotFoundError. Bounded: past the timeout every
agent's process group is killed and the test fails.
"""
from __future__ import annotations

import math
import os
import re
import shlex
import sys

import torch

from tests.helpers.doc_blocks import blocks_run_by
from tests.helpers.families import load, packed_batch, save_family
from tests.helpers.launcher import ROOT, agents_env, free_port, run_agents, start, wait_all
from tests.helpers.multinode_worker import LR
from tests.helpers.recipe_launch import assert_ranks_agree, rank_logs

TOL = 1e-5
GUIDE = "docs/guides/multi-node.md"
TIMING = {"tokens_per_s", "peak_mem_gib"}  # wall-clock and per-rank memory: may differ between ranks


def _reference(path: str) -> dict:
    model = load(path)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses, grads = [], {}
    for seed in (0, 1):
        loss = model(**packed_batch(seed=seed), use_cache=False).loss
        loss.backward()
        if not grads:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "updates": {n: p.detach() - before[n] for n, p in model.named_parameters()},
            "scale": {n: p.detach().abs().max().item() for n, p in model.named_parameters()}}


def test_two_nodes_train_exactly(tmp_path):
    path = save_family("llama", tmp_path)
    out = str(tmp_path / "rank0.pt")
    codes, logs = run_agents([os.path.join(ROOT, "tests", "helpers", "multinode_worker.py"), path, out], tmp_path)
    text = "\n".join(f"--- agent {n} ---\n" + log[-3000:] for n, log in enumerate(logs))
    assert codes == [0, 0], text
    assert "".join(logs).count("mesh_from_parallelism_config: ParallelismConfig(sp_size=4, sp_backend='deepspeed')") == 1, text
    got, ref = torch.load(out), _reference(path)
    assert got["degrees"] == (2, 2, 1), got["degrees"]
    nodes = {}
    for node, ring_rank, _ in got["places"]:  # ranks 0,1 on one node, 2,3 on the other
        nodes.setdefault(node, set()).add(ring_rank)
    assert sorted(nodes) == [0, 1] and all(len(r) == 1 for r in nodes.values()), got["places"]  # one ring rank per node
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= TOL * abs(b), f"step {step + 1}: loss {a} over two nodes vs {b} in one process"
    for name, want in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], want, rtol=TOL, atol=TOL * want.abs().max().item(), msg=name)
    ulp = torch.finfo(torch.float32).eps
    for name, want in ref["updates"].items():  # -LR x (gradient of step 1 + gradient of step 2)
        atol = TOL * want.abs().max().item() + 4 * ulp * ref["scale"][name]  # + the parameters' own fp32 rounding
        torch.testing.assert_close(got["updates"][name], want, rtol=TOL, atol=atol, msg=name)


def _demo_steps(log: str) -> list[tuple[str, ...]]:
    """(step, loss, lr, grad_norm) of each step line the demo's rank 0 prints, as printed."""
    return re.findall(r"step +(\d+) \| loss ([\d.]+) \| lr (\S+) \| grad_norm ([\d.]+) \|", log)


def test_guide_two_agents_train_the_demo_as_one_agent_does(tmp_path):
    (block,) = blocks_run_by(GUIDE, "tests/integration/test_multinode.py::test_guide_two_agents_train_the_demo_as_one_agent_does")
    port = str(free_port())
    script = block.text.replace("127.0.0.1:29400", f"127.0.0.1:{port}")
    assert script.count(port) == 2, block.text
    commands = [c for c in block.text.replace("\\\n", " ").splitlines() if c.startswith("torchrun")]
    demo_args = shlex.split(commands[-1].split("recipes/demo.py", 1)[1])
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir(), one.mkdir()
    os.symlink(os.path.join(ROOT, "recipes"), two / "recipes")
    env = {**agents_env(), "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}  # its torchrun
    with open(tmp_path / "block.log", "w") as log:
        proc = start(["bash", "-c", script], log, env, str(two))
        wait_all([proc], timeout_s=300)
    out = (tmp_path / "block.log").read_text()
    assert proc.returncode == 0 and "summary: loss" in out and "ChildFailedError" not in out, out[-4000:]
    assert "4 rank(s) on cpu (gloo): dp 1 x ring 2 x ulysses 2" in out, out[-4000:]
    steps = _demo_steps(out)
    assert [s[0] for s in steps] == ["1", "2"] and all(math.isfinite(float(s[1])) for s in steps), out[-4000:]
    codes, logs = run_agents([os.path.join(ROOT, "recipes", "demo.py"), *demo_args], one, nodes=1, procs=4,
                             cwds=[str(one)])
    assert codes == [0], logs[0][-4000:]
    assert _demo_steps(logs[0]) == steps, (steps, logs[0][-4000:])


def test_dpo_recipe_builds_its_model_and_trains_on_two_agents(tmp_path):
    out = tmp_path / "out"
    codes, logs = run_agents([os.path.join(ROOT, "recipes", "dpo.py"), "--ulysses", "2", "--steps", "2", "--pairs", "8",
                              "--timeout", "60", "--output-dir", str(out)], tmp_path)
    text = "\n".join(f"--- agent {n} ---\n" + log[-3000:] for n, log in enumerate(logs))
    assert codes == [0, 0], text
    steps = rank_logs(out, ranks=4)
    assert_ranks_agree(steps, [1, 2], TIMING)
    first, second = steps[0]
    assert abs(first["loss"] - math.log(2)) < 1e-5 and first["rewards/margins"] == 0.0, first  # policy == reference
    assert second["rewards/margins"] != 0.0, second  # the first update reached the policy


def test_dpo_recipe_names_an_output_dir_another_node_cannot_see(tmp_path):
    """Each agent resolves the relative --output-dir in its own directory: node 1 cannot see rank 0's build."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for d in nodes:
        d.mkdir()
    codes, logs = run_agents([os.path.join(ROOT, "recipes", "dpo.py"), "--ulysses", "2", "--steps", "1",
                              "--timeout", "60", "--output-dir", "out"], tmp_path, cwds=[str(d) for d in nodes],
                             timeout_s=200)
    text = "\n".join(f"--- agent {n} ---\n" + log[-3000:] for n, log in enumerate(logs))
    assert 0 not in codes, text
    said = re.compile(r"the tiny Llama that rank 0 built in (\S+) \(host [^)]*\) is not there for rank\(s\) 2, 3 .*"
                      r"Fix: pass an --output-dir on a file system every node mounts, or a prebuilt --model")
    built = {m.group(1) for m in said.finditer("".join(logs))}
    assert built & {str(d / "out" / "tiny-llama") for d in nodes}, text  # the node that built it: either agent
    assert all(said.search(log) for log in logs), text  # each node's log says it
    assert "FileNotFoundError" not in text and "HFValidationError" not in text, text
