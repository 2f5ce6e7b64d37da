"""What `hf-longctx plan` reads from its command line: sizes with units and a model's config
(and prints back: `gib`).

Where it sits: the argument types and the model loading of the `plan` subcommand
(`hf_longctx/cli/__init__.py` builds the parser, `cli/capacity.py` runs it); no planning here.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

_UNITS = {"b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> float:
    """'80GiB', '80 GB', '512g', '1e9B' → bytes (GiB/MiB binary, GB/G decimal); a trailing
    '/s' is allowed for bandwidths. A number without a unit is refused: '--gpu-memory 80'
    would be 80 bytes, surely not what was meant."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)(/s)?\s*", str(text))
    if m and not m.group(2):
        raise argparse.ArgumentTypeError(
            f"{text!r} has no unit (it would be {text} bytes): write e.g. {m.group(1)}GiB (binary), {m.group(1)}GB "
            f"(decimal), {m.group(1)}GB/s for a bandwidth, or {m.group(1)}B for bytes")
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"cannot read size {text!r}: use e.g. 80GiB, 80GB, 512G, 25GB/s")
    try:
        value = float(m.group(1)) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read size {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def gib(x: float) -> str:
    """Bytes as the plan prints them: GiB with one decimal (the unit its memory flags read)."""
    return f"{x / 2**30:.1f}"


def load_config(model: str) -> Any:
    """A transformers config from a config.json, a directory, or a locally cached name."""
    from transformers import AutoConfig

    path = Path(model)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--model {model!r}: not valid JSON ({e})") from None
        if "model_type" not in data:
            raise ValueError(f"--model {model!r}: config.json has no 'model_type'")
        return AutoConfig.for_model(data.pop("model_type"), **data)
    try:
        return AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"--model {model!r} is neither a config.json / model directory nor a name in the local Hugging Face "
            f"cache ({type(e).__name__}: {str(e).splitlines()[0]}); pass a path to its config.json"
        ) from None
