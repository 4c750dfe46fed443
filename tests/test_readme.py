"""The README cannot drift from the code: `make demo`'s commands and every command and Python
snippet in the README's code blocks run here, in order, in a scratch workspace laid out like the
repository (configs/ and the demo clips), on the tiny model. `make demo`'s commands run once per
session, in the `demo_workspace` fixture (tests/conftest.py) that tests/test_console.py shares."""

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


def run(command, cwd):
    command = re.sub(r"^(OMP_NUM_THREADS=1 )?\S*bin/tts-lightning ", f"OMP_NUM_THREADS=1 {CLI} ", command)
    command = re.sub(r"^tts-lightning ", f"OMP_NUM_THREADS=1 {CLI} ", command)
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
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


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command(workspace, command):
    run(command, workspace)


@pytest.mark.parametrize("index", range(len(code_blocks("python"))))
def test_readme_python_block(workspace, index):
    script = workspace / f"readme_block_{index}.py"
    script.write_text(code_blocks("python")[index])
    run(f"OMP_NUM_THREADS=1 {shlex.quote(sys.executable)} {script.name}", workspace)
