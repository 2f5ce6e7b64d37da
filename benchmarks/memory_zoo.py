"""Every causal LM of the installed transformers under the memory options, on one process.

Where it sits: beside benchmarks/zoo.py, which holds each family's default patch against the
unpatched model on two ranks. Here each model type is built tiny from its own config
(`zoo_configs.tiny_config`, fp32, `AutoModelForCausalLM.from_config`) and patched on a 1x1 mesh
twice more: with memory="max"'s knobs (checkpoint=True, 4 MLP chunks, chunked loss: the
row-chunked layers) and with "high"'s (checkpoint="attention", the same chunks), each against
the same model patched with memory="off" over two steps (`tests/helpers/patched_steps.py`: the
second step runs with what the first backward learnt). Verdicts: ok (loss within 1e-6 relative,
every gradient within 1e-5 of the largest), WRONG, REFUSED (patch or the step raised: its first
line), TIMEOUT; SKIP when memory="off" itself cannot run (patch refused the model), RANDOM when two
memory="off" runs differ (a model random in training mode: nothing to hold the options against).

    PYTHONPATH=. python benchmarks/memory_zoo.py                  (every type: ~10 min on 2 cores)
    PYTHONPATH=. python benchmarks/memory_zoo.py cohere gpt_oss   (a subset)
"""

from __future__ import annotations

import copy
import os
import signal
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.zoo import all_model_types  # noqa: E402
from benchmarks.zoo_configs import tiny_config  # noqa: E402
from tests.helpers.patched_steps import patched_steps, worst_errors  # noqa: E402

KNOBS = {"max": dict(checkpoint=True, mlp_chunks=4, loss_chunks="auto"),
         "high": dict(checkpoint="attention", mlp_chunks=4, loss_chunks="auto")}
TIMEOUT_S = 120


class _Timeout(Exception):
    pass


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:110]}"


def verdicts(model_type: str) -> dict:
    """{"off": SKIP reason or "", and per KNOBS name its verdict} for one model type."""
    import transformers as tf

    torch.manual_seed(0)
    try:
        base = tf.AutoModelForCausalLM.from_config(tiny_config(tf.CONFIG_MAPPING[model_type]), dtype=torch.float32)
        ref = patched_steps(copy.deepcopy(base), memory="off")
    except (Exception, _Timeout) as e:  # noqa: BLE001
        return {"off": f"SKIP ({_first_line(e)})"}
    again = worst_errors(patched_steps(copy.deepcopy(base), memory="off"), ref)
    if again[0] > 1e-8 or again[1] > 1e-7:  # random in training mode (PhiMoE samples its experts' jitter)
        return {"off": f"RANDOM (two memory='off' runs differ: loss {again[0]:.1e}, grad {again[1]:.1e})"}
    row = {"off": ""}
    for name, knobs in KNOBS.items():
        try:
            loss_err, grad_err = worst_errors(patched_steps(copy.deepcopy(base), **knobs), ref)
            ok = loss_err <= 1e-6 and grad_err <= 1e-5
            row[name] = f"{'ok' if ok else 'WRONG'} (loss {loss_err:.1e}, grad {grad_err:.1e})"
        except _Timeout:
            row[name] = "TIMEOUT"
        except Exception as e:  # noqa: BLE001
            row[name] = f"REFUSED ({_first_line(e)})"
    return row


def main(types: list[str]) -> None:
    import transformers as tf

    warnings.filterwarnings("ignore")
    tf.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)

    def expire(*_):
        raise _Timeout()

    signal.signal(signal.SIGALRM, expire)
    print("| model type | memory='max' knobs | memory='high' knobs |")
    print("|---|---|---|")
    counts: dict = {}
    for model_type in types or all_model_types():
        signal.alarm(TIMEOUT_S)
        try:
            row = verdicts(model_type)
        except _Timeout:
            row = {"off": "SKIP (TIMEOUT)"}
        finally:
            signal.alarm(0)
        cells = [row["off"]] * 2 if row["off"] else [row[n] for n in KNOBS]
        for cell in cells:
            counts[cell.split(" ")[0]] = counts.get(cell.split(" ")[0], 0) + 1
        print(f"| {model_type} | {cells[0]} | {cells[1]} |", flush=True)
    print("\nverdicts over both columns: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main(sys.argv[1:])
