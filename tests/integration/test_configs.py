"""Every YAML of accelerate_configs/ loads with Accelerate's own config loader, says what
it claims (process count, CPU/GPU, nodes), and comments every key."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "accelerate_configs")
EXPECTED = {  # file -> (distributed_type, num_processes, num_machines, use_cpu)
    "cpu_4proc.yaml": ("MULTI_GPU", 4, 1, True),
    "gpu_1node_8.yaml": ("MULTI_GPU", 8, 1, False),
    "gpu_2node_8.yaml": ("MULTI_GPU", 16, 2, False),
    "gpu_1_fpdt.yaml": ("NO", 1, 1, False),
}


def test_every_config_is_listed():
    assert sorted(f for f in os.listdir(CONFIGS) if f.endswith(".yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_with_accelerate(name):
    from accelerate.commands.config.config_args import load_config_from_file

    path = os.path.join(CONFIGS, name)
    cfg = load_config_from_file(path)
    dtype, nproc, nodes, cpu = EXPECTED[name]
    assert str(cfg.distributed_type).split(".")[-1] == dtype
    assert (cfg.num_processes, cfg.num_machines, bool(cfg.use_cpu)) == (nproc, nodes, cpu)
    assert not cfg.fsdp_config, "FSDP2 is applied by hf_longctx.fsdp_plan, not by Accelerate"
    with open(path) as f:
        keys = [line for line in f if line.strip() and not line.lstrip().startswith("#")]
    uncommented = [line.split(":")[0] for line in keys if "#" not in line]
    assert not uncommented, f"{name}: keys without a comment: {uncommented}"
