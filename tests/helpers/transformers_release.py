"""Questions about the installed transformers release that decide what a test expects.

`on_attention_interface(module_path)`: whether the release routes a family's attention
through AttentionInterface (`ALL_ATTENTION_FUNCTIONS` in its modeling module), so whether
patch() must accept the family or refuse it. Used by tests/integration/test_patch.py and
test_zoo_subset.py.
"""

from __future__ import annotations


def on_attention_interface(module_path: str) -> bool:
    """Whether this transformers release routes the family's attention through
    AttentionInterface (GPT-J and CodeGen moved onto it in transformers 5.24)."""
    import importlib
    import inspect

    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(importlib.import_module(module_path))
