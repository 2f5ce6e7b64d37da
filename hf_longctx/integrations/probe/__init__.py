"""The structural exactness rule (the dry run of `patch()`), one concept per file.

`dry_run.py` runs the model (the rule itself: see its docstring); `tracing.py` the hooks on
every module during the runs (record, compare, splice back, blame); `report.py` what it saw;
`compare.py` how a module's tensors are compared position by position; `masks.py` the walk
of HF's composed mask functions; `inputs.py` the probe lengths, the per-token stand-in
attention and the loss check.
"""
