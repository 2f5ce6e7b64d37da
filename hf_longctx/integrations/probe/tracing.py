"""The dry run's module hooks: run A recorded, runs B and C spliced back to it, each leak blamed.

Where it sits: `dry_run.probe_model` attaches one `RunTracer` to every submodule of the model
for its runs A (the probe), B (one token perturbed) and C (the suffix [a:S] alone). Guarantees:
in run A each call's sequence-aligned inputs and outputs are kept by (module name, n-th call);
in runs B and C a call whose tensors changed where they must not is blamed on the innermost
module whose own code changed them (`leaks` for B, `shape_deps` for C) and run A's values are
put back, so one pass finds every source; modules inside a `handled` class are trusted;
`detach()` removes every hook."""

from __future__ import annotations

import torch

from hf_longctx.integrations.probe.compare import differs, flatten, rebuild, seq_view
from hf_longctx.integrations.probe.report import ProbeReport


class RunTracer:
    """The hooks on every submodule during the runs, and what they share: the current run,
    the n-th call of each module, the stack of modules entered, run A's tensors."""

    def __init__(self, hf, report: ProbeReport, s: int, a: int, handled: frozenset):
        self.hf, self.report, self.handled = hf, report, handled
        self.s, self.a = s, a  # the probe length S and the shard start a
        self.names = {id(m): n or type(m).__name__ for n, m in hf.named_modules()}
        self.outputs: dict = {}  # (module name, call idx) -> run A's outputs [tensor with a sequence dim, or None]
        self.inputs: dict = {}  # the same for the inputs (args and kwargs)
        self.run, self.counts, self.in_counts, self.stack = "A", {}, {}, []
        self.handles: list = []

    def start(self, run: str) -> None:
        """Begin run `run` ("A", "B" or "C"): call counts and the module stack start empty."""
        self.run, self.counts, self.in_counts, self.stack = run, {}, {}, []

    def where(self):
        """The innermost module entered and not yet left (the model when none)."""
        return self.stack[-1] if self.stack else self.hf

    def attach(self) -> None:
        """Hook every submodule (not the model itself): a pre-hook on its inputs, a hook on its outputs."""
        for m in self.hf.modules():
            if m is not self.hf:
                self.handles.append(m.register_forward_pre_hook(self.pre_hook, with_kwargs=True))
                self.handles.append(m.register_forward_hook(self.hook))

    def detach(self) -> None:
        """Remove every hook `attach()` added."""
        for h_ in self.handles:
            h_.remove()

    def splice(self, flat_now: list, ref: list, run: str):
        """(changed, spliced tensors): compare with run A's tensors at the same call; put
        back run A's values wherever a token other than the perturbed one changed."""
        s, a = self.s, self.a
        new, changed = [], False
        for t, r in zip(flat_now, ref):
            if r is None or not isinstance(t, torch.Tensor):
                new.append(t)
                continue
            dim = seq_view(r, s)
            if run == "B":
                shape = [1] * r.dim()
                shape[dim] = s
                other = (torch.arange(s, device=r.device) != 1).view(shape)  # broadcast over non-sequence dims
                if t.shape == r.shape and t.dtype == r.dtype and differs(torch.where(other, t, r), r):
                    changed, t = True, torch.where(other, r, t)
            else:  # run C: the shard [a:S] alone must reproduce run A at those tokens
                want = r.narrow(dim, a, s - a)
                # A tensor whose shape does not line up is not a sequence-aligned tensor (e.g. the
                # tokens an MoE loop gathered for one expert, whose count changes between runs).
                if t.shape == want.shape and t.dtype == want.dtype and differs(t, want):
                    changed, t = True, want.clone()
            new.append(t)
        return changed, new

    def blame(self, module, mname: str, run: str) -> None:
        """Note `module` (named `mname`) as a leak (run B) or a shard dependence (run C)."""
        if any(type(m) in self.handled for m in [module, *self.stack]):
            return  # inside an SP wrapper: it owns the exchange of its mixer's state
        target = (self.report.leaks if run == "B" else self.report.shape_deps).setdefault(type(module).__name__, [])
        if mname not in target:
            target.append(mname)

    def visit(self, store: dict, counts: dict, mname: str, flat: list) -> list | None:
        """Run A: record this call's sequence-aligned tensors in `store`. Runs B / C: the
        call's tensors with run A's values spliced back where they changed, or None."""
        key = (mname, counts.get(mname, 0))  # the n-th call of this module in the run
        counts[mname] = key[1] + 1
        run = self.run
        if run == "A":
            store[key] = [t.detach().clone() if seq_view(t, self.s) is not None else None for t in flat]
            return None
        ref = store.get(key)
        if ref is None or len(ref) != len(flat):
            return None
        changed, new = self.splice(flat, ref, run)
        return new if changed else None

    def pre_hook(self, module, args, kwargs):
        """Enter `module`; inputs that changed already are its parent's doing: blame it, splice back."""
        parent = self.where()
        self.stack.append(module)
        mname = self.names.get(id(module), type(module).__name__)
        new = self.visit(self.inputs, self.in_counts, mname, flatten((args, kwargs), []))
        if new is None:
            return None
        # the inputs already differ: the PARENT's own code (not a submodule) mixed tokens
        self.blame(parent, self.names.get(id(parent), type(parent).__name__), self.run)
        return rebuild((args, kwargs), iter(new))

    def hook(self, module, args, output):
        """Leave `module`; outputs that changed are its own doing: blame it, splice back."""
        self.stack.pop()
        mname = self.names.get(id(module), type(module).__name__)
        new = self.visit(self.outputs, self.counts, mname, flatten(output, []))
        if new is None:
            return None
        self.blame(module, mname, self.run)
        return rebuild(output, iter(new))
