"""MkDocs hook: every public name is documented and has its place in the API reference.

Public names are `hf_longctx.__all__`; for a class also its own public methods and properties
(members overriding `transformers.Trainer`'s are the Trainer's API, documented there). Each
problem is logged as a warning, so `mkdocs build --strict` (`make docs`) fails on a name
without a docstring or without a `::: path` directive on a page of docs/reference/api/.
`tests/unit/test_docs_site.py` runs the same check without MkDocs."""

from __future__ import annotations

import inspect
import logging
import re
import sys
from pathlib import Path

API_DIR = Path("docs/reference/api")
DIRECTIVE = re.compile(r"^::: *([\w.]+)", re.M)


def _trainer_names() -> set[str]:
    try:
        from transformers import Trainer
    except ImportError:
        return set()
    return set(dir(Trainer))


def _own_members(cls: type, skip: set[str]):
    """(name, function or property) defined on `cls` itself, public, not a Trainer override."""
    for name, value in vars(cls).items():
        if name.startswith("_") or name in skip:
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property) or inspect.isfunction(value):
            yield name, value


def _has_doc(obj) -> bool:
    return bool((inspect.getdoc(obj) or "").strip())


def problems(root: Path) -> list[str]:
    """Every public name without a docstring or an API-reference directive, one line each."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import hf_longctx

    text = "\n".join(p.read_text() for p in sorted((root / API_DIR).glob("*.md")))
    referenced = set(DIRECTIVE.findall(text))
    skip = _trainer_names()
    found = []
    for name in hf_longctx.__all__:
        obj = getattr(hf_longctx, name)
        path = f"{obj.__module__}.{obj.__qualname__}"
        if not referenced & {path, f"hf_longctx.{name}"}:
            found.append(f"hf_longctx.{name} is on no page of {API_DIR}: add '::: {path}' to one")
        if not _has_doc(obj):
            found.append(f"hf_longctx.{name} ({path}) has no docstring")
        if inspect.isclass(obj):
            found += [f"hf_longctx.{name}.{m} ({path}.{m}) has no docstring"
                      for m, member in _own_members(obj, skip) if not _has_doc(member)]
    return found


def on_pre_build(config, **kwargs) -> None:
    log = logging.getLogger("mkdocs.hooks.api_check")
    for line in problems(Path(config.config_file_path).parent):
        log.warning(line)
