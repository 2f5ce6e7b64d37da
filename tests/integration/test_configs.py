"""Every YAML of accelerate_configs/ loads with Accelerate's own config loader, says what
it claims (process count, CPU/GPU, nodes), and comments every key; the two-node ones launch as
their comments say (`accelerate launch` run as far as the `torch.distributed.run` call it makes,
which is stubbed: nodes, ranks per node, node rank, rendezvous, and the PARALLELISM_CONFIG_*
variables hf_longctx maps onto the mesh); the Slurm script runs with stub `scontrol`, `srun` and
`torchrun` on PATH and starts one torchrun agent per node with the rendezvous on the first."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "accelerate_configs")
EXPECTED = {  # file -> (distributed_type, num_processes, num_machines, use_cpu)
    "cpu_4proc.yaml": ("MULTI_GPU", 4, 1, True),
    "gpu_1node_8.yaml": ("MULTI_GPU", 8, 1, False),
    "gpu_2node_8.yaml": ("MULTI_GPU", 16, 2, False),
    "gpu_2node_sp.yaml": ("MULTI_GPU", 16, 2, False),
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


def _launch(monkeypatch, name: str, *flags: str) -> tuple:
    """(torchrun's arguments, the launch environment's PARALLELISM variables) of `accelerate launch
    --config_file accelerate_configs/NAME FLAGS train.py --ulysses 8`, stopped at torch.distributed.run."""
    import torch.distributed.run as distrib_run
    from accelerate.commands.launch import launch_command, launch_command_parser

    seen = {}

    def run(args):  # what torchrun would start; the environment is the workers'
        seen["args"], seen["env"] = args, {k: v for k, v in os.environ.items() if "PARALLELISM" in k}

    monkeypatch.setattr(distrib_run, "run", run)
    args = launch_command_parser().parse_args(
        ["--config_file", os.path.join(CONFIGS, name), *flags, "train.py", "--ulysses", "8"])
    launch_command(args)
    return seen["args"], seen["env"]


@pytest.mark.parametrize("name", ["gpu_2node_8.yaml", "gpu_2node_sp.yaml"])
def test_two_node_configs_launch_as_documented(monkeypatch, name):
    from tests.helpers.launcher import free_port

    port = free_port()  # node 0 checks that its rendezvous port is free
    for node, flags in ((0, ["--main_process_port", str(port)]), (1, ["--machine_rank", "1"])):
        run, env = _launch(monkeypatch, name, *flags)
        assert (run.nnodes, run.nproc_per_node, run.node_rank, run.rdzv_backend) == ("2", "8", node, "static")
        assert run.rdzv_endpoint == f"10.0.0.1:{port if node == 0 else 29500}", run.rdzv_endpoint
        assert (run.training_script, run.training_script_args) == ("train.py", ["--ulysses", "8"])
        if name == "gpu_2node_8.yaml":
            assert env == {}, env
            continue
        assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true" and env["PARALLELISM_CONFIG_SP_SIZE"] == "16"
        from hf_longctx.integrations.parallelism_config import launcher_parallelism_config, map_parallelism_config

        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            pc = launcher_parallelism_config()  # what the trainers read on every rank
        mapped = map_parallelism_config(pc, world_size=16, heads=(32, 8), ranks_per_node=8)
        assert (mapped.ulysses, mapped.ring, mapped.dp) == (8, 2, 1)  # Ulysses inside a node, ring across


STUBS = {  # name -> bash body; every call is appended to $LOG
    # a long host list: a reader that stops at the first line would SIGPIPE the writer (exit 141 under pipefail)
    "scontrol": ('echo "scontrol $*" >> "$LOG"; [ "$1 $2" = "show hostnames" ] && printf "gpu-a17\\ngpu-a18\\n" '
                 '&& seq -f "gpu-b%g" 1 200000'),
    "srun": ('echo "srun $*" >> "$LOG"; while [[ "$1" == --* ]]; do shift; done\n'
             'for node in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$node "$@"; done'),
    "torchrun": 'echo "torchrun[$SLURM_NODEID] $* NCCL_DEBUG=$NCCL_DEBUG" >> "$LOG"',
}


def test_slurm_script_starts_one_agent_per_node(tmp_path):
    import subprocess

    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    script = os.path.join(CONFIGS, "slurm_2node.sbatch")
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "LOG": str(log), "SLURM_JOB_NODELIST": "gpu-a[17-18]",
           "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", script, "recipes/sft.py", "--ulysses", "8", "--ring", "2"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    agent = ("--nnodes 2 --nproc-per-node 8 --rdzv-id 4242 --rdzv-backend c10d --rdzv-endpoint gpu-a17:29500 "
             "recipes/sft.py --ulysses 8 --ring 2 NCCL_DEBUG=WARN")
    assert calls == [
        "scontrol show hostnames gpu-a[17-18]",
        "srun --kill-on-bad-exit=1 --ntasks-per-node=1 torchrun " + agent.removesuffix(" NCCL_DEBUG=WARN"),
        f"torchrun[0] {agent}",
        f"torchrun[1] {agent}",
    ], calls
    options = [line[len("#SBATCH --"):].strip().partition("=") for line in open(script) if line.startswith("#SBATCH --")]
    header = {key: value for key, _, value in options}
    assert header["nodes"] == "2" and header["gpus-per-node"] == "8" and header["ntasks-per-node"] == "1"
