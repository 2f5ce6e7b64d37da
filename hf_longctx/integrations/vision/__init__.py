"""Image-text-to-text models under sequence parallelism.

`families.py` (per-family adapters: VisionSpec + encoder call), `classification.py` (EXACT /
REFUSED table), `registry.py` (lookup, `vision_spec`), `binding.py` (what `patch()` changes
for a VLM), `forward.py` (the vision hook: encode this rank's share, one exchange).
"""
