"""Shared test code: what more than one test module (or a benchmark) needs.

Test modules (`test_*.py`) import from here and never from one another
(tests/unit/test_test_layout.py checks it). One concept per module: the process pools,
the single-process references, the case tables, the emulated backends and kernels, the
tiny models and the trainer/recipe set-ups the tests share.
"""
