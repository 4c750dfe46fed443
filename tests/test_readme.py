"""The README cannot drift from the code: `make demo`'s commands and every command and Python
snippet in the README's code blocks run here, in order, in a scratch workspace laid out like the
repository (configs/ and the demo clips), on the tiny model. `make demo`'s commands run once per
session, as typed (fresh interpreters, Lightning's own launcher for the 2-rank fit), in the
`demo_workspace` fixture (tests/conftest.py) that tests/test_console.py shares. The README's
commands and snippets then run through the tests' launcher (tests/launcher.py): the same argv and
entry point, every rank started at once as torchrun would, forked from warm interpreters."""

import re
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


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
    assert (workspace / "runs" / "tiny-model" / "config.json").is_file()
    assert (workspace / "runs" / "tiny-cpu" / "checkpoints" / "last.ckpt").exists()
    assert (workspace / "runs" / "tiny-cpu" / "voice").is_dir()
    assert (workspace / "runs" / "tiny-cpu" / "hello_alice.wav").is_file()
    # configs/demo/listen.yaml: the demo shows samples beside the real clips and the codebook chart.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in (workspace / "runs" / "tiny-cpu" / "lightning_logs").rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events), size_guidance={"tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    assert "custom_scalars__config__" in tags["tensors"] and "val/acc_codebook_mean" in tags["scalars"], tags
    assert {"spectrograms_vs_real/alice/0", "spectrograms_vs_real/bob/0"} <= set(tags["images"]), tags
    assert {"real/alice", "real/bob", "samples/alice/0"} <= set(tags["audio"]), tags


@pytest.fixture(scope="module")
def readme_runs(workspace, run_cli):
    """Every command of the README's code blocks, run once, in README order, in the workspace where
    `make demo` ran: {command: (exit status, output)}."""
    results = {}
    for command in readme_commands():
        proc = run_cli(*shlex.split(command)[1:], cwd=workspace, check=False)
        results[command] = (proc.returncode, proc.stdout + proc.stderr)
    return results


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command(readme_runs, command):
    code, output = readme_runs[command]
    assert code == 0, f"{command}: exit status {code}\n{output[-6000:]}"


@pytest.mark.parametrize("index", range(len(code_blocks("python"))))
# After the commands: block 1 reads runs/my-voice.
def test_readme_python_block(readme_runs, workspace, run_script, index):
    script = workspace / f"readme_block_{index}.py"
    script.write_text(code_blocks("python")[index])
    run_script(script.name, timeout=900, cwd=workspace)
