"""The public `hf_longctx.patch()`: `integrations/model_patch.patch` plus the optional
`verify()` backstop.

Where it sits: one floor above `verify.py`, which itself sits above `integrations/` (it
patches a reduced copy of the model to measure it). `verify=True` runs that measurement
after every structural check of `patch()` has passed and before the model is changed, so
the integrations floor never imports `verify` (no import circle: DESIGN "Package layout").
"""

from __future__ import annotations

import inspect
from typing import Any

from hf_longctx.flex.bank import GroupBank
from hf_longctx.distributed.mesh import SPMesh
from hf_longctx.integrations import model_patch as _integration
from hf_longctx.verify import verify as _verify


def patch(model: Any, mesh: SPMesh | GroupBank, *, verify: bool = False, **options: Any) -> Any:
    """`hf_longctx.integrations.model_patch.patch(model, mesh, **options)` -- every option
    (`memory`, the four knobs, `unsafe_skip_exactness_check`) is documented there and shown
    by `help()` -- plus `verify`.

    Args:
        model: A `PreTrainedModel` or a PEFT model.
        mesh: An `SPMesh` (`init_sequence_parallel`) or a `GroupBank` (`init_group_bank`).
        verify: Also run `hf_longctx.verify(model, mesh)` (fp32, on a copy of the first layer
            of each distinct layer class; collective over the SP group) once every structural
            check has passed and before the model is changed.
        **options: The options of `integrations.model_patch.patch`: `memory`,
            `inputs_on_device`, `keep_attention`, `mixers`, the four knobs (`kv_offload`,
            `mlp_chunks`, `loss_chunks`, `checkpoint`) and `unsafe_skip_exactness_check`.

    Returns:
        `model`, patched.

    Raises:
        VerificationError: `verify=True` and SP is not exact for this model (the model is
            then left unpatched).
        NotSupported: SP cannot be exact for this model or setting; nothing is changed.
    """
    if "before_install" in options:
        raise TypeError("patch() got an unexpected keyword argument 'before_install'")
    measured = getattr(mesh, "patch_mesh", mesh)  # SPMesh and GroupBank; anything else is refused below
    check = (lambda: _verify(model, measured, mixers=options.get("mixers"))) if verify else None
    return _integration.patch(model, mesh, before_install=check, **options)


def _public_signature() -> inspect.Signature:
    """integrations' signature with `before_install` replaced by `verify` (what help() shows)."""
    full = inspect.signature(_integration.patch)
    params = [p for p in full.parameters.values() if p.name != "before_install"]
    at = next(i for i, p in enumerate(params) if p.name == "unsafe_skip_exactness_check")
    params.insert(at, inspect.Parameter("verify", inspect.Parameter.KEYWORD_ONLY, default=False, annotation="bool"))
    return full.replace(parameters=params)


patch.__signature__ = _public_signature()
