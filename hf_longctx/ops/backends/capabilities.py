"""What each local attention kernel can take: the table the dispatcher reads.

Where it sits: `ops/backends/select.py` keeps the kernels whose row here accepts the call
(device, dtype, head dim, softcap, window, GPU architecture) and picks among them -- the one
named, else the fastest measured; a refusal is reported with its reason, once.
docs/concepts/usp.md shows the same table; `tests/unit/test_backends.py` checks the dispatch
against it.
Facts (flash-attn v2.6.0-v2.8.3 sources, torch 2.13 schemas and sources, nvidia-cudnn-frontend
1.32): every CUDA kernel needs sm80+ and fp16/bf16, takes GQA and cumulative lengths, no
arbitrary mask, and rounds its output to the input dtype. The flash kernels take head dims
<= 256 (multiples of 8) and bottom-right (left, right) windows; only flash-attn has softcap.
cuDNN takes head dims <= 128 here (256 only on sm90 with cuDNN >= 9.10, per torch's
sdp_utils: not taken until measured); through torch's ops it is top-left causal with no
window; through cudnn-frontend it takes bottom-right bands."""

from __future__ import annotations

from typing import NamedTuple

import torch

_HALF = (torch.float16, torch.bfloat16)


class Capability(NamedTuple):
    name: str
    device: str  # "cuda", "cpu" or "any"
    dtypes: tuple[torch.dtype, ...]
    max_head_dim: int | None  # None: any
    head_dim_multiple: int
    min_capability: tuple[int, int] | None  # CUDA compute capability
    window: str  # how sliding windows are expressed
    gqa: str
    lse: str
    softcap: bool
    causal: str  # alignment of the kernel's causal flag
    packed: bool  # one call covers many documents (cumulative lengths)
    fp32_partial_out: bool  # can hand an un-rounded partial output to a merge
    windows: bool = True  # computes a sliding-window call exactly


CAPABILITIES: dict[str, Capability] = {
    "flash_attn": Capability(
        "flash_attn", "cuda", _HALF, 256, 8, (8, 0), "(left, right) native", "native", "[H, total_q] fp32",
        True, "bottom-right", True, False,
    ),
    "torch_flash": Capability(
        "torch_flash", "cuda", _HALF, 256, 8, (8, 0), "(left, right) native", "native", "[H, total_q] fp32",
        False, "bottom-right", True, False,
    ),
    "cudnn": Capability(
        "cudnn", "cuda", _HALF, 128, 8, (8, 0), "none: refused", "native", "[H, total_q] fp32 ([T, H, 1] in older torch)",
        False, "top-left: every causal call square", True, False, windows=False,
    ),
    "cudnn_frontend": Capability(
        "cudnn_frontend", "cuda", _HALF, 128, 8, (8, 0), "(left + 1, right) band, bottom-right", "native",
        "[total_q, H, 1] fp32; padded [B, H, max_q, 1] to the backward", False, "bottom-right", True, False,
    ),
    "aten_cpu": Capability(
        "aten_cpu", "cpu", (torch.float32, torch.float64, torch.bfloat16, torch.float16), None, 1, None,
        "additive mask per tile", "K/V expanded once per call", "[B, H, S] fp32 (0 for an empty row)",
        False, "top-left", False, True,  # bf16/fp16 tiles that are merged run in fp32 (aten_cpu._widened)
    ),
    "math": Capability(
        "math", "any", (torch.float32, torch.float64, torch.bfloat16, torch.float16), None, 1, None,
        "bool mask per tile", "broadcast views", "[B, H, S] fp32/fp64", True, "top-left", False, True,
    ),
}


def refusal(
    name: str, *, device: str, dtype: torch.dtype, head_dim: int, softcap: float | None,
    capability: tuple[int, int] | None = None, window: int | None = None,
) -> str | None:
    """Why kernel `name` cannot run this call, or None if it can."""
    cap = CAPABILITIES[name]
    if cap.device not in ("any", device):
        return f"{name} runs on {cap.device}, not {device}"
    if dtype not in cap.dtypes:
        return f"{name} takes {', '.join(str(d).replace('torch.', '') for d in cap.dtypes)}, not {str(dtype).replace('torch.', '')}"
    if (cap.max_head_dim is not None and head_dim > cap.max_head_dim) or head_dim % cap.head_dim_multiple:
        return f"{name} takes head dims <= {cap.max_head_dim} that are multiples of {cap.head_dim_multiple}, not {head_dim}"
    if softcap is not None and not cap.softcap:
        return f"{name} has no logit softcap"
    if window is not None and not cap.windows:
        return f"{name} has no sliding window (window {window})"
    if cap.min_capability is not None and capability is not None and tuple(capability) < cap.min_capability:
        return f"{name} needs compute capability >= {cap.min_capability[0]}.{cap.min_capability[1]}, this GPU has {capability[0]}.{capability[1]}"
    return None


def markdown_table() -> str:
    """The table as markdown for docs/concepts/usp.md (so the page and the code cannot drift apart)."""
    head = "| kernel | device | dtypes | head dim | window | GQA | lse | softcap | causal | packed docs | fp32 partial out |"
    rows = [head, "|" + "---|" * 11]
    for c in CAPABILITIES.values():
        dims = "any" if c.max_head_dim is None else f"<= {c.max_head_dim}, % {c.head_dim_multiple}"
        dtypes = ", ".join(str(d).replace("torch.", "") for d in c.dtypes)
        rows.append(
            f"| {c.name} | {c.device}{'' if c.min_capability is None else f' sm{c.min_capability[0]}{c.min_capability[1]}+'} "
            f"| {dtypes} | {dims} | {c.window} | {c.gqa} | {c.lse} | {'yes' if c.softcap else 'no'} | {c.causal} "
            f"| {'one varlen call' if c.packed else 'one call per tile'} | {'yes' if c.fp32_partial_out else 'no (rounded to input dtype)'} |"
        )
    return "\n".join(rows)
