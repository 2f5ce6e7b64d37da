"""Two nodes, launched: two `torchrun --nnodes 2 --nproc-per-node 2` agents on this machine.

Each agent is its own process (and process group), as on two hosts; they meet through a c10d
rendezvous on 127.0.0.1 at a free port (agent 0 hosts the store: `is_host`), and the 4 workers
train over gloo (tests/helpers/multinode_worker.py): the mesh of `ParallelismConfig(sp_size=4)`
with 2 ranks per node puts Ulysses inside each node and the ring across the two. Two SGD steps
on packed batches must equal the unpatched model in one process: the global loss of each step,
every gradient of the first and every parameter's change over both (-lr x the two steps'
gradients) within 1e-5 relative to the tensor's largest entry (fp32: reordered sums of ~50 token
terms move the result by ~1e-7; a lost target or an averaged reduction is off by >= 1e-2); a
change also carries the rounding of the two fp32 parameters it is the difference of (4 ulps of
the largest, ~1e-9, where the smallest changes are ~3e-5). SGD,
not Adam: Adam's first update is ~lr x sign(g), so a gradient entry of 1e-9 (below its eps)
rounded differently would move a parameter by ~lr whatever the accuracy of the step.
The mapping is said once, by rank 0. Bounded: past 300 s every process group is killed and the
test fails (tests/helpers/launcher.py).
"""

from __future__ import annotations

import os

import torch

from tests.helpers.families import load, packed_batch, save_family
from tests.helpers.launcher import ROOT, run_agents
from tests.helpers.multinode_worker import LR

TOL = 1e-5


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
