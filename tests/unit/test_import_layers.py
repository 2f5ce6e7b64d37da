"""The package's imports flow one way (docs/DESIGN.md "Package layout"): no import circle,
no import from a higher floor, every module named on exactly one floor, and DESIGN's rules on
third-party imports (`data/` never imports torch.distributed, `ops/` never imports
transformers or accelerate).

Every `import` / `from ... import` statement in `hf_longctx/` counts, also those inside
functions (a deferred import is still a dependency; it only hides a circle from Python).
An import of a package's `__init__` by its own submodules' importers is not an edge (Python
runs parent packages first whatever the layering). The floors below are DESIGN's, lowest
first; a module may import its own floor or lower, and nothing on its floor that imports it
back. A floor names modules exactly: "x" is the module x only, "x.*" the package x and every
module under it -- a new top-level module must be placed on a floor by name.

The seams between modules are held here too: the rooms of training/ are floors of their own
(TRAINING_FLOORS); no private name is imported from another module; only the owners of the
patch state name the model attribute that holds it; no mesh or patch state is typed `Any`.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "hf_longctx"

# lowest first: (floor name, modules on it: "x" is module x, "x.*" package x and everything under it)
FLOORS = (
    ("base", ("hf_longctx.errors", "hf_longctx.config", "hf_longctx._compat", "hf_longctx.model_walk", "hf_longctx.devices")),
    ("layout", ("hf_longctx.layout", "hf_longctx.sp_groups")),
    ("data", ("hf_longctx.data.*",)),
    ("distributed", ("hf_longctx.distributed.*",)),
    ("flex", ("hf_longctx.flex.*",)),
    ("ops", ("hf_longctx.ops.*",)),
    ("capacity", ("hf_longctx.capacity.*",)),
    ("integrations", ("hf_longctx.integrations.*",)),
    ("verify", ("hf_longctx.verify",)),
    ("patching", ("hf_longctx.patching",)),
    ("generation", ("hf_longctx.generation.*",)),
    ("training", ("hf_longctx.training.*",)),
    ("top", ("hf_longctx.cli.*", "hf_longctx")),
)

# The rooms of training/, lowest first (DESIGN "Package layout"): the refusal tables below the shared
# trainer base, the SFT mixin (which LongDPOTrainer extends) below the objectives, RLOO over GRPO's
# rollout trainer, the launcher, the seam list and the package itself on top.
TRAINING_FLOORS = (
    ("refusals", ("hf_longctx.training.refusals.*",)),
    ("base", ("hf_longctx.training.base.*",)),
    ("sft", ("hf_longctx.training.sft.*",)),
    ("objectives", ("hf_longctx.training.dpo.*", "hf_longctx.training.grpo.*")),
    ("rloo", ("hf_longctx.training.rloo.*",)),
    ("top", ("hf_longctx.training", "hf_longctx.training.launch", "hf_longctx.training.seam")),
)

# The only modules that name the patched model's attribute holding its PatchState: where it is
# named (model_walk: `installed_patch`, its one reader), the state's own module, and patch()/unpatch(),
# which write and remove it. Everyone else asks `patch_state(model)` / `installed_patch(model)`.
PATCH_STATE_OWNERS = ("hf_longctx.model_walk", "hf_longctx.integrations.patch_state", "hf_longctx.integrations.model_patch")

# DESIGN's third-party rules: (modules, imports they must never make, why)
THIRD_PARTY_RULES = (
    ("hf_longctx.data.*", ("torch.distributed",), "data/ is pure Python + torch tensors"),
    ("hf_longctx.ops.*", ("transformers", "accelerate"), "ops/ is pure tensor code"),
    *((m, ("torch.distributed", "transformers", "accelerate"), "the layout floor is index arithmetic on torch tensors")
      for m in ("hf_longctx.layout", "hf_longctx.sp_groups")),
)


def matches(module: str, entry: str) -> bool:
    """`entry` names `module` exactly, or (`x.*`) is the package holding it."""
    if entry.endswith(".*"):
        package = entry[:-2]
        return module == package or module.startswith(package + ".")
    return module == entry


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_edges(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its source)."""
    edges: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from .x import y
                    stem = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(stem + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods and "." in target:
                    target = target.rsplit(".", 1)[0]  # hf_longctx.x.y.Class -> hf_longctx.x.y
                if target in mods and target != name:
                    edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def floor_of(module: str, floors: tuple = FLOORS) -> int:
    """The floor of `module`: the one floor whose entries name it."""
    found = [i for i, (_, entries) in enumerate(floors) if any(matches(module, e) for e in entries)]
    if not found:
        raise AssertionError(f"{module} is on no floor: add it to FLOORS and to docs/DESIGN.md")
    if len(found) > 1:
        raise AssertionError(f"{module} is on several floors: {[floors[i][0] for i in found]}")
    return found[0]


def outside_names(tree: ast.AST) -> set[str]:
    """The dotted names a parsed source imports from outside the package:
    `import torch.distributed as dist` -> torch.distributed; `from torch import distributed`
    -> torch and torch.distributed."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {n for n in names if n.split(".")[0] != "hf_longctx"}


def external_imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """module -> what it imports from outside the package (anywhere in its source)."""
    return {name: outside_names(ast.parse(path.read_text(), str(path))) for name, path in mods.items()}


def third_party_violations(imports: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} imports {name} ({why})"
        for entry, banned, why in THIRD_PARTY_RULES
        for module, names in imports.items() if matches(module, entry)
        for name in names
        if any(name == b or name.startswith(b + ".") for b in banned)
    )


def upward_edges(edges: dict[str, set[str]], floors: tuple = FLOORS, within: str = "hf_longctx.*") -> list[str]:
    """Imports from a higher floor of `floors`, among the modules `within` names."""
    inside = {m for m in edges if matches(m, within)}
    return sorted(
        f"{a} ({floors[floor_of(a, floors)][0]}) imports {b} ({floors[floor_of(b, floors)][0]})"
        for a, targets in edges.items() if a in inside
        for b in targets if b in inside
        if floor_of(b, floors) > floor_of(a, floors)
    )


def private_imports(mods: dict[str, pathlib.Path]) -> list[str]:
    """`from hf_longctx.x import _name` in another module: a helper two modules need is public in
    the module that owns it. A private module (`_compat`) imported by name is no private name."""
    out = []
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                stem = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(stem + ([node.module] if node.module else []))
            if base != "hf_longctx" and not base.startswith("hf_longctx."):
                continue
            out += [f"{name}:{node.lineno} imports {base}.{a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__") and f"{base}.{a.name}" not in mods]
    return sorted(out)


def names_used(tree: ast.AST) -> set[str]:
    """Every plain name a parsed source uses or imports."""
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return used | {a.asname or a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}


def test_no_import_circle_in_the_package():
    found = cycles(import_edges(modules()))
    assert not found, f"import circles in hf_longctx/: {found}"


def test_no_import_from_a_higher_floor():
    bad = upward_edges(import_edges(modules()))
    assert not bad, "imports from a higher floor (docs/DESIGN.md 'Package layout'):\n" + "\n".join(bad)


def test_every_module_is_on_a_floor():
    for name in modules():
        floor_of(name)


def test_a_module_named_on_no_floor_is_caught():
    """A new top-level module, or one in a new package, is on no floor until FLOORS names it
    (the package's own name matches only its `__init__`)."""
    for name in ("hf_longctx.newmodule", "hf_longctx.newpackage.part", "hf_longctx.verify.part"):
        with pytest.raises(AssertionError, match="is on no floor"):
            floor_of(name)
    assert FLOORS[floor_of("hf_longctx")][0] == "top"
    assert FLOORS[floor_of("hf_longctx.data")][0] == "data"


def test_third_party_rules_hold():
    bad = third_party_violations(external_imports(modules()))
    assert not bad, "imports docs/DESIGN.md rules out:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, module", [
    ("import torch.distributed as dist", "hf_longctx.data.packing"),
    ("from torch import distributed", "hf_longctx.data.plan"),
    ("from torch.distributed.tensor import DTensor", "hf_longctx.data"),
    ("from transformers import PreTrainedModel", "hf_longctx.ops.ring"),
    ("import accelerate", "hf_longctx.ops.backends.select"),
    ("import torch.distributed as dist", "hf_longctx.layout"),
    ("from transformers import PretrainedConfig", "hf_longctx.sp_groups"),
])
def test_each_third_party_rule_fails_when_broken(source, module):
    """Each rule, broken by one import added to a real module, is reported."""
    imports = external_imports(modules())
    assert not third_party_violations({module: imports[module]})
    imports[module] = imports[module] | outside_names(ast.parse(source))
    assert [v for v in third_party_violations(imports) if v.startswith(f"{module} imports ")]


@pytest.mark.parametrize(
    "edges, expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set(), "c": {"c"}}, []),  # a self-import is no circle
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_the_circle_finder_finds_circles(edges, expected):
    assert sorted(cycles(edges)) == expected


def test_a_deferred_import_back_is_caught():
    """The circle this test was written for: integrations/model_patch.py importing verify
    inside patch() while verify imports patch. With that edge added back to the real graph,
    both checks fail."""
    edges = import_edges(modules())
    edges["hf_longctx.integrations.model_patch"] = edges["hf_longctx.integrations.model_patch"] | {"hf_longctx.verify"}
    assert any("hf_longctx.verify" in c and "hf_longctx.integrations.model_patch" in c for c in cycles(edges))
    assert any(e.startswith("hf_longctx.integrations.model_patch (integrations) imports hf_longctx.verify") for e in upward_edges(edges))


def test_no_import_from_a_higher_room_of_training():
    """Inside training/ the rooms are floors too (TRAINING_FLOORS): a refusal table never imports an
    objective's code, the shared base never imports a trainer built on it."""
    for name in modules():
        if matches(name, "hf_longctx.training.*"):
            floor_of(name, TRAINING_FLOORS)
    bad = upward_edges(import_edges(modules()), TRAINING_FLOORS, "hf_longctx.training.*")
    assert not bad, "imports from a higher room of training/:\n" + "\n".join(bad)


def test_an_upward_import_in_training_is_caught():
    """The edge this rule was written for: refusals/dpo.py importing dpo/ (which imports it back)."""
    edges = import_edges(modules())
    edges["hf_longctx.training.refusals.dpo"] = edges["hf_longctx.training.refusals.dpo"] | {"hf_longctx.training.dpo.data"}
    bad = upward_edges(edges, TRAINING_FLOORS, "hf_longctx.training.*")
    assert bad == ["hf_longctx.training.refusals.dpo (refusals) imports hf_longctx.training.dpo.data (objectives)"]


def test_no_private_name_is_imported_across_modules():
    bad = private_imports(modules())
    assert not bad, "private names imported from another module (make them public where they live):\n" + "\n".join(bad)


def test_a_private_import_is_caught(tmp_path):
    mods = modules()
    probe = tmp_path / "probe.py"
    probe.write_text("from hf_longctx.integrations.layer_rows import kwargs_rows as _rows\n"
                     "from hf_longctx import _compat\n"
                     "from hf_longctx.ops.fpdt import _helper\n"
                     "from .layout import _private\n")
    found = private_imports({"hf_longctx.probe": probe, **{k: v for k, v in mods.items() if k == "hf_longctx._compat"}})
    assert found == ["hf_longctx.probe:3 imports hf_longctx.ops.fpdt._helper",
                     "hf_longctx.probe:4 imports hf_longctx.layout._private"]


def test_only_its_owners_name_the_patch_state_attribute():
    """No attribute back door: a module that wants what patch() installed asks `patch_state(model)`
    (or, below integrations, `model_walk.installed_patch(model)`), never the model's attribute."""
    bad = sorted(name for name, path in modules().items() if name not in PATCH_STATE_OWNERS
                 and names_used(ast.parse(path.read_text())) & {"PATCH_STATE_ATTR", "STATE_ATTR"})
    assert not bad, f"modules reading the patch state off the model by attribute name: {bad}"


# A seam typed `Any` says nothing: a mesh is a `Mesh` (or an `SPMesh`, a `RankLayout`, a DeviceMesh),
# a patch's state a `PatchState`, a callback's state the Trainer's `TrainerState`.
UNTYPED_SEAM_NAMES = ("mesh", "state")


def untyped_seams(sources: dict[str, str]) -> list[str]:
    """Parameters and annotated attributes named `mesh`, `*_mesh` or `state` annotated `Any`
    (alone, or with None)."""
    def is_any(node: ast.AST | None) -> bool:
        text = ast.unparse(node) if node is not None else ""
        return text.replace(" ", "") in ("Any", "typing.Any", "Any|None", "None|Any", "Optional[Any]", "'Any'", '"Any"')

    def seam(name: str) -> bool:
        return name in UNTYPED_SEAM_NAMES or name.endswith("_mesh")

    out = []
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.arg) and seam(node.arg) and is_any(node.annotation):
                out.append(f"{module}:{node.lineno} {node.arg}: {ast.unparse(node.annotation)}")
            elif isinstance(node, ast.AnnAssign) and is_any(node.annotation):
                target = node.target.attr if isinstance(node.target, ast.Attribute) else getattr(node.target, "id", "")
                if seam(target):
                    out.append(f"{module}:{node.lineno} {target}: {ast.unparse(node.annotation)}")
    return sorted(out)


def test_no_mesh_or_state_is_typed_any():
    bad = untyped_seams({name: path.read_text() for name, path in modules().items()})
    assert not bad, "seams typed Any (use Mesh / SPMesh / RankLayout / PatchState / TrainerState):\n" + "\n".join(bad)


def test_an_untyped_seam_is_caught():
    source = ("from typing import Any, Optional\n"
              "def f(mesh: Any, world_mesh: Optional[Any] = None, state: 'Any' = None, model: Any = None): ...\n"
              "class C:\n    device_mesh: Any | None\n    plan: Any\n"
              "    def __init__(self, state: Any) -> None:\n        self.state: Any = state\n")
    assert sorted(line.split(" ", 1)[1] for line in untyped_seams({"m": source})) == [
        "device_mesh: Any | None", "mesh: Any", "state: 'Any'", "state: Any", "state: Any", "world_mesh: Optional[Any]"]
