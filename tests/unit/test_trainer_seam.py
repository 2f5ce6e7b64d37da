"""The Trainer seam (`hf_longctx/training/seam.py`) holds against the installed transformers and TRL,
and it is the whole seam.

Each entry's parent member exists in this release: a method with the parameters the code relies
on, leading and in order (`inspect.signature`), an attribute named in the parent's source. Every
method our trainers, mixins and callbacks define whose name a library parent has is listed as an
override; every `self._x` they touch (or `getattr(self, "_x")`) whose name a library parent uses and
our class does not define is listed as a call, read or write; no entry is stale.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
import re
import textwrap

import pytest
import transformers
import trl
from transformers.trainer_callback import PrinterCallback, ProgressCallback, TrainerCallback

import hf_longctx.training
from hf_longctx.training.base.faults import WatchdogCallback
from hf_longctx.training.base.log_lines import NumberPrinterCallback, NumberProgressCallback
from hf_longctx.training.base.trainer import SPTrainerBase
from hf_longctx.training.dpo.trainer import LongDPOTrainer
from hf_longctx.training.grpo.resume import RolloutResumeCallback
from hf_longctx.training.grpo.rollout_trainer import SPRolloutTrainer
from hf_longctx.training.grpo.trainer import LongGRPOTrainer
from hf_longctx.training.rloo.trainer import LongRLOOTrainer
from hf_longctx.training.seam import HOOKS, Hook
from hf_longctx.training.sft.trainer import LongContextTrainer, LongContextTrainerMixin

LIBRARY = ("transformers", "trl")
TRL_ALL = (transformers.Trainer, trl.SFTTrainer, trl.DPOTrainer, trl.GRPOTrainer, trl.RLOOTrainer)
# Our classes and the library classes each is composed with (a mixin has none in its own MRO).
OURS = {
    SPTrainerBase: TRL_ALL,
    LongContextTrainerMixin: (transformers.Trainer, trl.SFTTrainer, trl.DPOTrainer),
    LongContextTrainer: (transformers.Trainer,),
    LongDPOTrainer: (trl.DPOTrainer,),
    SPRolloutTrainer: (trl.GRPOTrainer, trl.RLOOTrainer),
    LongGRPOTrainer: (trl.GRPOTrainer,),
    LongRLOOTrainer: (trl.RLOOTrainer,),
    NumberProgressCallback: (ProgressCallback,),
    NumberPrinterCallback: (PrinterCallback,),
    WatchdogCallback: (TrainerCallback,),
    RolloutResumeCallback: (TrainerCallback,),
}


def resolve(path: str) -> type:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def library_classes(bases) -> list[type]:
    return [c for b in bases for c in b.__mro__ if c.__module__.split(".")[0] in LIBRARY]


@functools.cache
def source_names(cls: type) -> frozenset[str]:
    """The member names a library class defines, and every `self.x` its source touches."""
    try:
        return frozenset(vars(cls)) | frozenset(re.findall(r"self\.(\w+)", inspect.getsource(cls)))
    except (OSError, TypeError):
        return frozenset(vars(cls))


def parent_names(bases) -> set[str]:
    return {n for c in library_classes(bases) for n in source_names(c)}


def problems(hook: Hook, parent: type) -> list[str]:
    """What no longer holds of `hook` on `parent` in the installed release (empty: it holds)."""
    where = f"{hook.ours}.{hook.name} ({hook.kind} of {parent.__module__}.{parent.__qualname__})"
    if hook.kind in ("override", "call"):
        member = getattr(parent, hook.name, None)
        if not callable(member):
            return [f"{where}: the parent has no such method"]
        names = [p for p in inspect.signature(member).parameters][1:]  # without self
        if names[: len(hook.params)] != list(hook.params):
            return [f"{where}: relies on parameters {list(hook.params)}, the release has {names}"]
        return []
    if hook.name not in parent_names((parent,)) and not hasattr(parent, hook.name):
        return [f"{where}: no `self.{hook.name}` in the parent's source"]
    return []


@pytest.mark.parametrize("hook, parent", [(h, p) for h in HOOKS for p in h.parents],
                         ids=lambda x: x.name if isinstance(x, Hook) else x)
def test_each_entry_holds_on_the_installed_release(hook, parent):
    assert hook.kind in ("override", "call", "read", "write") and hook.why
    assert not problems(hook, resolve(parent))


def test_a_renamed_parameter_or_a_missing_attribute_fails_naming_the_entry():
    class Parent:
        def _save_checkpoint(self, model, run):  # a release that renamed `trial`
            ...

    hook = Hook("SPTrainerBase", "_save_checkpoint", ("x.Parent",), "override", ("model", "trial"), "why")
    assert problems(hook, Parent) == ["SPTrainerBase._save_checkpoint (override of "
                                      f"{__name__}.{Parent.__qualname__}): relies on parameters ['model', 'trial'], "
                                      "the release has ['model', 'run']"]
    gone = Hook("LongDPOTrainer", "_metrics", ("x.Parent",), "read", why="why")
    assert problems(gone, Parent)[0].endswith("no `self._metrics` in the parent's source")


def test_every_trainer_class_of_the_package_is_covered():
    """A new trainer, mixin or callback under training/ joins OURS (and its hooks the seam list)."""
    found = set()
    for info in pkgutil.walk_packages(hf_longctx.training.__path__, "hf_longctx.training."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (inspect.isclass(obj) and obj.__module__ == info.name
                    and issubclass(obj, (transformers.Trainer, TrainerCallback, SPTrainerBase))):
                found.add(obj)
    assert found <= set(OURS), f"classes missing from OURS: {sorted(c.__name__ for c in found - set(OURS))}"


def overrides(cls, bases) -> set[str]:
    """Methods `cls` itself defines whose name a library parent has (`__init__` included)."""
    names = {n for c in library_classes(bases) for n in vars(c)}
    return {n for n, v in vars(cls).items()
            if n in names and (not n.startswith("__") or n == "__init__")
            and (callable(v) or isinstance(v, (property, staticmethod, classmethod)))}


def test_every_override_is_listed_and_every_listed_override_exists():
    listed = {(h.ours, h.name) for h in HOOKS if h.kind == "override"}
    found = {(cls.__name__, n) for cls, bases in OURS.items() for n in overrides(cls, bases)}
    assert found - listed == set(), f"overrides missing from training/seam.py: {sorted(found - listed)}"
    assert listed - found == set(), f"stale overrides in training/seam.py: {sorted(listed - found)}"


def touched(cls, private: bool = True) -> set[str]:
    """Names `cls`'s own source reads, writes or calls on `self` (`super()._x` is an override)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            out.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
              and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"
              and isinstance(node.args[1], ast.Constant)):
            out.add(node.args[1].value)
    return {n for n in out if not private or (n.startswith("_") and not n.startswith("__"))}


def ours_defined(cls) -> set[str]:
    """Names our own classes in `cls`'s MRO define (methods, class attributes)."""
    return {n for c in cls.__mro__ if c.__module__.startswith("hf_longctx") for n in vars(c)}


def test_every_parent_private_attribute_touched_is_listed():
    listed = {(h.ours, h.name) for h in HOOKS if h.kind != "override"}
    found = {(cls.__name__, n) for cls, bases in OURS.items()
             for n in touched(cls) if n in parent_names(bases) and n not in ours_defined(cls)}
    assert found - listed == set(), f"parent-private attributes missing from training/seam.py: {sorted(found - listed)}"
    used = {(cls.__name__, n) for cls in OURS for n in touched(cls, private=False)}
    stale = {(h.ours, h.name) for h in HOOKS if h.kind != "override"} - used
    assert not stale, f"stale entries in training/seam.py (not in the class's source): {sorted(stale)}"
