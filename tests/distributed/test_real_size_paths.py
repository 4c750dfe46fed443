"""What the released models on real GPUs need, checked on CPU with real FSDP processes: weights
loaded unit by unit from rank 0, collectives on the root device only, every rank running the same
FSDP units whatever its batch holds, and checkpoints renamed on every node."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def setup_results(tmp_path_factory, tiny_dir, demo_data, run_script):
    _, manifest, cache = demo_data
    out = tmp_path_factory.mktemp("setup-checks")
    run_script(HERE / "setup_worker.py", tiny_dir, manifest, cache, out, timeout=240, cwd=out, ranks=2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_meta_loading_is_bit_identical_on_every_rank(setup_results):
    for result in setup_results:
        assert result["weights_keys_equal"], result
        assert result["weights_bit_identical"], result


def test_collectives_only_see_the_root_device(setup_results):
    for result in setup_results:
        assert result["collectives"] >= 4  # shard report, speaker owner + table, the reduction
        assert result["collective_devices"] == [result["root_device"]], result


def test_speaker_table_sync_through_the_strategy(setup_results):
    """The table is synced through the process group: rank 1, which saw only speaker 1, gets
    speaker 0's row from rank 0, and speaker 1's row, seen by both, is taken once (not summed):
    both ranks hold exactly the prepared table."""
    assert [r["batch_speakers"] for r in setup_results] == [[0, 1], [1]]
    for result in setup_results:
        assert result["speaker_rows_filled"] == [0, 1], result["speaker_rows_filled"]
        assert result["speaker_table"] == result["prepared_table"]


def test_fsdp_clips_by_the_norm_over_all_shards(setup_results):
    """Lightning's own path (`Trainer(gradient_clip_val=...)` ends in `LightningModule.clip_gradients`)
    works under FSDP, the module knowing nothing of it: the strategy's precision plugin has the FSDP
    root compute the norm over every shard, the norm of the unsharded model's gradient."""
    for result in setup_results:
        clip = result["clipping"]
        assert clip["plugin"] == "Qwen3TTSFSDPPrecision"
        assert clip["grad_norm_fsdp"] > 0
        assert clip["grad_norm_fsdp"] == pytest.approx(clip["grad_norm_plain"], rel=1e-4)
        assert clip["grad_norm_clipped"] == pytest.approx(clip["clip_val"], rel=1e-4)
    assert setup_results[0]["clipping"]["grad_norm_fsdp"] == setup_results[1]["clipping"]["grad_norm_fsdp"]


def test_a_rank_missing_codebooks_runs_the_same_units(setup_results):
    full, partial = setup_results
    assert full["codebooks_present"] == 16 and partial["codebooks_present"] == 1
    for result in setup_results:  # no hang, and the loss of a plain model on the same batch
        assert result["loss_fsdp"] == pytest.approx(result["loss_plain"], abs=1e-5)


# -- checkpoints on node-local storage ---------------------------------------------------------------
NODE_SCRIPT = """
import sys
from pathlib import Path

import lightning as L
import torch

from tts_lightning.distributed.fsdp import Qwen3TTSFSDPStrategy

local, report = Path(sys.argv[1]), Path(sys.argv[2])


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=Qwen3TTSFSDPStrategy(auto_wrap_policy=[]),
                    max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(Tiny(), train_dataloaders=torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=2))
trainer.save_checkpoint(local / "step.ckpt")
listing = sorted(str(p.relative_to(local)) for p in local.rglob("*"))
(report / f"node{trainer.node_rank}.txt").write_text("\\n".join(listing))
"""


def test_each_node_renames_its_own_checkpoint_files(tmp_path):
    """Two 'nodes' (one process each, node ranks 0 and 1), each with its own private tmpfs mounted
    at the same path (a mount namespace per process): the node-local storage of a real cluster."""
    local, report = tmp_path / "node-local", tmp_path / "report"
    local.mkdir()
    report.mkdir()
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    port = str(29500 + os.getpid() % 1000)
    procs = []
    for node in (0, 1):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "WORLD_SIZE": "2",
            "NODE_RANK": str(node),
            "LOCAL_RANK": "0",
            "GROUP_RANK": str(node),
        }
        command = f"mount -t tmpfs -o size=64m tmpfs {local} && exec {sys.executable} {script} {local} {report}"
        procs.append(
            subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", command],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    assert not list(local.iterdir()), "the tmpfs mounts leaked into the test's namespace"
    listings = {node: (report / f"node{node}.txt").read_text().splitlines() for node in (0, 1)}
    for node, files in listings.items():
        assert "step.ckpt" in files, (node, files)
        assert not any(".partial" in f or ".old" in f for f in files), (node, files)
    assert "step.ckpt/__1_0.distcp" in listings[1] and "step.ckpt/.metadata" in listings[0]
    shutil.rmtree(report)
