"""Sequence-parallel generation on the training mesh: `sp_generate` (generation/loop.py), its
sampling settings (settings.py), the owner's sampling (sampler.py), the prefill (prefill.py), the
weights' place for a rollout (weights.py) and the checks (checks.py). Design: docs/DESIGN.md
"Generation is sequence-parallel too"."""
