"""The README cannot drift from the code: `make demo`'s commands and every command and Python
snippet in the README's code blocks run here, in order, in a scratch workspace laid out like the
repository (configs/ and the demo clips), on the tiny model. `make demo`'s commands run once per
session, in the `demo_workspace` fixture (tests/conftest.py) that tests/test_console.py shares.
Commands that start processes of their own (fit, predict, ray-fit) run as typed; runs of other
commands (plan, export, ...) share one process through the `tts-lightning` entry point
(tests/readme_runner.py), which saves an interpreter start and the imports per command."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
CLI = f"{shlex.quote(sys.executable)} -m tts_lightning"
RUNNER = Path(__file__).with_name("readme_runner.py")
MARKER = "@@readme-runner "
# Commands that start other processes from their own command line (Lightning re-runs it for each
# rank; Ray starts workers): each runs alone, as typed. The other commands (the tools) run in
# groups of consecutive ones, one process per group (tests/readme_runner.py).
ALONE = ("fit", "validate", "test", "predict", "ray-fit")


def code_blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def readme_commands():
    commands = []
    for block in code_blocks("bash"):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("tts-lightning "):
                commands.append(line)
    return commands


def demo_commands():
    """The commands `make demo` runs, as make prints them (the install step excluded)."""
    printed = subprocess.run(["make", "-n", "-B", "demo"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    lines = re.sub(r"\\\n\s*", " ", printed).splitlines()
    return [line for line in lines if "bin/tts-lightning " in line]


def run(command, cwd, check=True):
    command = re.sub(r"^(OMP_NUM_THREADS=1 )?\S*bin/tts-lightning ", f"OMP_NUM_THREADS=1 {CLI} ", command)
    command = re.sub(r"^tts-lightning ", f"OMP_NUM_THREADS=1 {CLI} ", command)
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert not check or proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def workspace(demo_workspace):
    """The scratch workspace where `make demo`'s commands ran; the README's commands go on from there."""
    return demo_workspace[0]


def test_readme_has_the_two_commands_on_top():
    first = code_blocks("bash")[0]
    assert [line.split("#")[0].strip() for line in first.strip().splitlines()] == ["make demo", "make test"]
    assert README.index("make demo") < README.index("## ")


def test_make_demo_commands(demo_workspace):
    workspace, outputs = demo_workspace  # the fixture ran them, and failed on a non-zero exit
    assert list(outputs) == ["tiny-model", "fit", "export", "synthesize"]
    assert [c.split("tts-lightning ")[1].split()[0] for c in demo_commands()] == list(outputs)
    assert (workspace / "runs" / "tiny-model" / "config.json").is_file()
    assert (workspace / "runs" / "tiny-cpu" / "checkpoints" / "last.ckpt").exists()
    assert (workspace / "runs" / "tiny-cpu" / "voice").is_dir()
    assert (workspace / "runs" / "tiny-cpu" / "hello_alice.wav").is_file()


def command_groups(commands):
    """The commands in README order, consecutive tools grouped: [(alone, [command, ...]), ...]."""
    groups: list[tuple[bool, list[str]]] = []
    for command in commands:
        alone = shlex.split(command)[1] in ALONE
        if alone or not groups or groups[-1][0]:
            groups.append((alone, [command]))
        else:
            groups[-1][1].append(command)
    return groups


def run_group(commands, cwd):
    """Run tools in one process, in order, through the entry point of the `tts-lightning` script:
    {command: (exit status, its output)}; a command after a crash of the process gets status None."""
    argvs = [shlex.split(command)[1:] for command in commands]
    proc = subprocess.run(
        [sys.executable, str(RUNNER), json.dumps(argvs)],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    results, output = {}, ""
    pending = iter(commands)
    for line in proc.stdout.splitlines(keepends=True):
        if line.startswith(MARKER):
            results[next(pending)] = (json.loads(line[len(MARKER) :])["code"], output)
            output = ""
        else:
            output += line
    for command in pending:
        results[command] = (None, f"{output}\n(the runner exited with {proc.returncode} before this command)")
    return results


@pytest.fixture(scope="module")
def readme_runs(workspace):
    """Every command of the README's code blocks, run once, in README order, in the workspace where
    `make demo` ran: {command: (exit status, output)}."""
    results = {}
    for alone, commands in command_groups(readme_commands()):
        if alone:
            proc = run(commands[0], workspace, check=False)
            results[commands[0]] = (proc.returncode, proc.stdout + proc.stderr)
        else:
            results.update(run_group(commands, workspace))
    return results


def test_tools_are_grouped_and_process_starting_commands_run_alone():
    groups = command_groups(readme_commands())
    assert [c for _, group in groups for c in group] == readme_commands()  # all of them, in order
    assert any(len(group) > 1 for _, group in groups)
    for alone, group in groups:
        if alone:
            assert len(group) == 1 and shlex.split(group[0])[1] in ALONE
        else:
            assert all(shlex.split(c)[1] not in ALONE for c in group)


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command(readme_runs, command):
    code, output = readme_runs[command]
    assert code == 0, f"{command}: exit status {code}\n{output[-6000:]}"


@pytest.mark.parametrize("index", range(len(code_blocks("python"))))
def test_readme_python_block(readme_runs, workspace, index):  # after the commands (block 1 reads my-voice)
    script = workspace / f"readme_block_{index}.py"
    script.write_text(code_blocks("python")[index])
    run(f"OMP_NUM_THREADS=1 {shlex.quote(sys.executable)} {script.name}", workspace)
