"""The switches `make test-bf16-isa` relies on: ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA, read by
torch at start-up, change the kernels a bf16 run uses (so the bf16 tests can be run on this CPU as
on one without AVX512 / AVX512-BF16 / AMX).

In a fresh interpreter (the variables are read once per process): `default` selects torch's
scalar kernels and `avx2` its AVX2 ones (on any x86 CPU with AVX2); ONEDNN_MAX_CPU_ISA=AVX2 turns
oneDNN's bf16 path off; and a bf16 softmax over AVX2 kernels rounds differently from the scalar
kernels on the same input -- the difference the bf16 criterion has to hold through.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

PROBE = (
    "import json, torch; torch.manual_seed(0); x = torch.randn(64, 1000).bfloat16(); "
    "print(json.dumps({'cap': torch.backends.cpu.get_cpu_capability(), 'onednn_bf16': torch.ops.mkldnn._is_mkldnn_bf16_supported(), "
    "'softmax': torch.softmax(x, -1).double().pow(2).sum().item()}))"
)


def _probe(**env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT", reason="no vectorised kernels on this CPU")
def test_forced_isa_changes_the_kernels():
    scalar = _probe(ATEN_CPU_CAPABILITY="default", ONEDNN_MAX_CPU_ISA="AVX2")
    avx2 = _probe(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    assert scalar["cap"] == "DEFAULT" and avx2["cap"] == "AVX2", (scalar, avx2)
    assert not scalar["onednn_bf16"] and not avx2["onednn_bf16"]  # oneDNN capped below AVX512: no bf16 path
    assert scalar["softmax"] != avx2["softmax"], "the scalar and AVX2 bf16 softmax kernels agreed bit for bit"
