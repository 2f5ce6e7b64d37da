"""HF's activation-checkpointing flag under its current name, in the recipes and the docs.

transformers >= 5.18 names it `activation_checkpointing`; `gradient_checkpointing` is its
deprecated alias (a FutureWarning; removed in v6), and TRL's configs default the alias to True,
so they warn unless the new name is given. `recipes/common.checkpointing(on)` gives the field
under the installed release's name; no recipe passes the alias, and the trainer guide documents the
new name (the trainers map either to `patch(checkpoint=True)`: tests/integration/test_train_single.py).
"""

from __future__ import annotations

import ast
import os
import warnings

from tests.helpers.recipe_launch import recipe_modules

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _common():
    (common,) = recipe_modules("common")
    return common


def test_the_recipe_helper_names_the_current_field_and_trl_does_not_warn(tmp_path):
    import transformers
    from trl import SFTConfig

    from hf_longctx._compat import checkpointing_fields

    kw = _common().checkpointing(False)
    assert list(kw) == [checkpointing_fields(transformers.TrainingArguments)[0]]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        config = SFTConfig(str(tmp_path), report_to=[], use_cpu=True, bf16=False, **kw)
    assert not [w for w in seen if "gradient_checkpointing" in str(w.message)], [str(w.message) for w in seen]
    assert config.gradient_checkpointing is False  # TRL's default (True) overridden


def test_no_recipe_passes_the_deprecated_alias_and_the_trainer_guide_names_the_new_one():
    from hf_longctx._compat import checkpointing_fields
    import transformers

    if checkpointing_fields(transformers.TrainingArguments)[0] != "activation_checkpointing":
        return  # transformers 5.17: the alias is the only name
    used = []
    for name in sorted(os.listdir(os.path.join(ROOT, "recipes"))):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(ROOT, "recipes", name)).read())
            used += [f"{name}:{k.lineno}" for k in ast.walk(tree) if isinstance(k, ast.keyword) and k.arg == "gradient_checkpointing"]
    assert not used, f"recipes pass the deprecated gradient_checkpointing= (use checkpointing(on)): {used}"
    pages = {name: open(os.path.join(ROOT, name)).read() for name in ("README.md", "docs/guides/trainer.md")}
    assert not [name for name, text in pages.items() if "`gradient_checkpointing=True`" in text]
    assert "`activation_checkpointing=True`" in pages["docs/guides/trainer.md"]
