"""Every command README.md and docs/ show runs as written, with only its step counts and output folders made tiny.

The commands are read from the indented code blocks of README.md and docs/*.md (`$ ` prompts and continuation lines handled);
every one must be classified below, so a command added to the README without a test here fails
`test_every_readme_command_is_classified`. Each runs in a sandbox directory holding a copy of `recipes/`, so
its relative output folders (`runs/...`) land there; the copied YAML configs run 2 RL steps with an
evaluation and a checkpoint at step 2, `--steps N` becomes `--steps 2`, and the checkpoint the README exports
(`step-000100`) becomes `step-000002`. The cheap commands run in the default suite; the ones that train (each
builds its warm-started base first) are one slow test, in the README's order, exports and evaluations last.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[2]
RUNNERS = ("python ", "allsync ", "accelerate launch ", "torchrun ")

FAST = [
    "allsync make-tiny runs/tiny",
    "allsync make-tiny runs/tiny-fp8 --fp8 --experts 16 --layers 4 --dense-layers 1 --seed 3",
    "allsync load runs/tiny-fp8 --routed-experts nf4 --attention fp8 --shared-experts int8 --dense-mlp bf16",
    "python recipes/arithmetic_parquet.py",
    "allsync plan --config recipes/configs/dapo_math_deepseek_v3_671b.yaml --shape deepseek-v3 --colocation sleep --search",
]
SLOW = [
    "accelerate launch recipes/dapo.py",
    "python recipes/nlft.py",
    "python recipes/nlft.py --reads-notes",
    "accelerate launch recipes/dapo.py --config my.yaml --resume",
    "python recipes/dapo.py --no-ray --steps 20 --out-dir runs/dapo-20",
    "accelerate launch recipes/dapo.py --config recipes/configs/tiny_cpu_tppo.yaml",
    "python recipes/dapo.py --config recipes/configs/tiny_cpu_parquet.yaml",
    "allsync eval runs/dapo-tiny-parquet/adapter --base runs/tiny-base --data runs/data/arithmetic-eval.parquet --n 8 --top-p 1.0 "
    "--max-new-tokens 16 --reward arithmetic --out runs/eval-parquet",
    "python recipes/dapo.py --config recipes/configs/tiny_cpu_memory.yaml",
    "python recipes/dapo.py --config recipes/configs/tiny_cpu_memory_single.yaml",
    "python recipes/dapo.py --config recipes/configs/tiny_cpu_memory_long.yaml",
    "python recipes/dapo.py --config recipes/configs/tiny_cpu_agent_calculator.yaml",
    "torchrun --standalone --nproc_per_node 2 recipes/dapo.py --config recipes/configs/tiny_cpu_ep2.yaml --steps 20",
    "python recipes/dapo.py --config recipes/configs/tiny_cpu_ep2.yaml --steps 20 --out-dir runs/dapo-tiny-ep2-ray",
    "allsync export runs/dapo-tiny/checkpoints/step-000100 --base runs/tiny-base --out runs/adapter --format peft",
    "allsync check-vllm runs/adapter --base runs/tiny-base --expert-parallel 2",
    "allsync export runs/dapo-tiny/checkpoints/step-000100 --base runs/tiny-base --out runs/merged --format merged --dtype fp8",
    "allsync export runs/dapo-tiny/checkpoints/step-000100 --base runs/tiny-base --out runs/merged-as-trained --format merged "
    "--merge-into trained --routed-experts nf4",
]
# commands whose exit code is not 0 by design: `allsync plan` exits 1 for a layout that does not fit (this one)
EXIT_CODES = {FAST[-1]: 1}
NOT_RUN = {  # what the tests run another way
    "python -m pytest -q": "the test command itself",
    "torchrun --standalone --nproc_per_node 2 repro.py": "docs/vllm-dp-moe-lora.md's reproduction of a vLLM defect "
    "on two GPUs; tests/allsync/engines/test_vllm_moe_lora_cpu.py runs it through the CPU harness",
}


def readme_commands(text: str) -> list[str]:
    """The commands of README.md's indented code blocks that start with a runner, in order: a `$ ` prompt and a
    trailing `# comment` stripped, `\\` continuation lines joined; fenced blocks (Python code) are skipped."""
    commands, fenced, pending = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or not line.startswith("    "):
            pending = ""
            continue
        part = line.strip()
        if not pending:
            part = part.removeprefix("$ ").removeprefix("bash install.sh && ")
            if not part.startswith(RUNNERS):
                continue
        part = re.sub(r"\s+#.*$", "", part)
        if part.endswith("\\"):
            pending += part[:-1].strip() + " "
            continue
        commands.append(pending + part)
        pending = ""
    return commands


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_readme_command_is_classified():
    found = [c for path in DOCUMENTS for c in readme_commands(path.read_text())]
    unknown = [c for c in found if c not in FAST + SLOW and c not in NOT_RUN]
    assert not unknown, f"README.md / docs commands this test does not run: {unknown}"
    assert set(FAST + SLOW) <= set(found), f"no longer in README.md or docs/: {sorted(set(FAST + SLOW) - set(found))}"


# what the sandbox's configs run: the commands' code paths, not their results (the README's numbers are measured in
# BENCHMARKS.md): 2 steps, evaluated and checkpointed at step 2, on 40 held-out problems once each, from bases
# warm-started for 60 steps (the 750 of the shipped configs took a minute or two for each of the 6 bases)
TINY_RUN = {"steps": 2, "eval_every": 2, "checkpoint_every": 2, "eval_samples": 1}
TINY_HELDOUT, TINY_WARM_START_STEPS = 40, 60


def sandbox(tmp_path: Path) -> Path:
    """A directory with a copy of recipes/ whose configs run tiny (TINY_RUN and the rest above)."""
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    for path in (tmp_path / "recipes" / "configs").glob("tiny_cpu*.yaml"):
        config = yaml.safe_load(path.read_text())
        config.setdefault("run", {}).update(TINY_RUN)
        if "heldout_size" in config.get("task", {}):
            config["task"]["heldout_size"] = TINY_HELDOUT
        if config["model"].get("warm_start"):
            config["model"]["warm_start_steps"] = TINY_WARM_START_STEPS
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    return tmp_path


# recipes/nlft.py made tiny as the training runs are (2 steps each): one seed, one epoch over 10 examples, avg@1
# (the README's commands ran 3 seeds x 8 epochs over 50 examples, twice SFT and NLFT: about 10 minutes of the lane)
TINY_NLFT = " --seeds 0 --epochs 1 --examples 10 --heldout-samples 1"


def tiny(command: str) -> str:
    """The command with its step counts and the checkpoint it names made tiny; a placeholder config made real."""
    command = re.sub(r"--steps \d+", "--steps 2", command).replace("step-000100", "step-000002")
    if command.startswith("python recipes/nlft.py"):
        command += TINY_NLFT
    return command.replace("--config my.yaml", "--config recipes/configs/tiny_cpu.yaml")


def run(command: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    done = subprocess.run(tiny(command), shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    expected = EXIT_CODES.get(command, 0)
    assert done.returncode == expected, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_the_cheap_readme_commands_run(tmp_path):
    """FAST's commands, two at a time (each is mostly one core importing torch; `allsync load` reads what the second
    make-tiny wrote, so it waits for it)."""
    from concurrent.futures import ThreadPoolExecutor

    cwd = sandbox(tmp_path)
    loads = [c for c in FAST if c.startswith("allsync load ")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = {c: pool.submit(run, c, cwd, 300) for c in FAST if c not in loads}
        done = {c: f.result() for c, f in first.items()}
        done.update({c: run(c, cwd, 300) for c in loads})
    outputs = [done[command].stdout for command in FAST]
    assert (cwd / "runs" / "tiny" / "model.safetensors.index.json").exists()
    assert "routed_experts" in outputs[2] and "nf4" in outputs[2]
    assert "wrote runs/data/arithmetic-train.parquet: 20,000 rows" in outputs[3]
    assert "verdict: does not fit: the generate phase with one sequence of 21,504 tokens" in outputs[4]
    assert "(77.0 of 76.5 GB: 85.0 GB less the 10% margin)" in outputs[4]
    assert "layouts of this config on 48 GPUs that fit" in outputs[4]


@pytest.mark.slow
def test_the_readme_commands_that_train_run(tmp_path):
    """Every training command of the README (2 steps each), then the exports and the evaluation of what they wrote."""
    cwd = sandbox(tmp_path)
    run("python recipes/arithmetic_parquet.py", cwd, 300)  # the parquet run's data
    last = [c for c in SLOW if c.startswith(("allsync export", "allsync check-vllm", "allsync eval"))]
    for command in [c for c in SLOW if c not in last] + last:
        done = run(command, cwd, 1800)
        if "recipes/dapo.py" in command:
            assert re.search(r"held-out accuracy: base [\d.]+% -> trained [\d.]+%", done.stdout), command
        if command.startswith("allsync check-vllm"):
            assert "vLLM accepted: 1 MoE layers x 4 experts x 3 projections" in done.stdout, done.stdout
