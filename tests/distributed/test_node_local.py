"""Two nodes of 2 ranks (4 CPU processes), each node seeing a folder of its own at the same path (a
mount namespace per process, tests/zygote.py): the run's paths (checkpoints, cache) then name
node-local storage, as they do on machines with disks of their own. A run writes sharded
checkpoints there, removes superseded ones on every node, resumes on every node from its own
folder, and ends with the weights of the same run on shared storage; a full checkpoint, which only
rank 0's node holds, is refused at resume with the setting to change."""

import shutil

import pytest
import torch
from launcher import launch
from tiny_runs import TINY_CPU

from tts_lightning.model.checkpoint import CheckpointReader, load_training_checkpoint

pytestmark = pytest.mark.slow


def _args(tiny_dir, *extra):
    return [
        "-m",
        "tts_lightning",
        "fit",
        "--config",
        TINY_CPU,
        "--trainer.devices",
        2,
        "--trainer.num_nodes",
        2,
        "--data.pretrained",
        tiny_dir,
        "--data.train_manifest",
        "demo/train.jsonl",
        "--data.cache_dir",
        "cache",
        "--data.max_frames_per_batch",
        150,
        "--trainer.default_root_dir",
        "run",
        "--trainer.val_check_interval",
        1,
        "--checkpoint.save_top_k",
        1,
        *extra,
    ]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, demo_data):
    """A disk per node and one for the shared-storage reference, each with the demo clips and the
    session's prepared cache, and the path at which each node sees its own."""
    demo, _, cache = demo_data
    root = tmp_path_factory.mktemp("nodes")
    made = {"mount": root / "disk"}
    made["mount"].mkdir()
    for name in ("node0", "node1", "shared", "full0", "full1"):
        shutil.copytree(demo / "demo", root / name / "demo")
        shutil.copytree(cache, root / name / "cache")
        made[name] = root / name
    return made


def _fit(zygotes, folders, disks, tiny_dir, *extra, check=True):
    args = [str(a) for a in _args(tiny_dir, *extra)]
    return launch(args, ranks=4, cwd=folders["mount"], node_disks=disks, zygotes=zygotes, timeout=240, check=check)


def _checkpoints(folder):
    return sorted(p.name for p in (folder / "run" / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def trained(folders, tiny_dir, zygotes):
    """3 steps on node-local disks, validated and checkpointed at every step (top-k 1)."""
    nodes = [folders["node0"], folders["node1"]]
    _fit(zygotes, folders, nodes, tiny_dir, "--trainer.max_steps", 3)
    return nodes


def test_node_local_checkpoints_write_prune_and_resume_on_every_node(trained, folders, tiny_dir, zygotes, tmp_path):
    nodes = trained
    # Top-k 1 with a validation every step: superseded checkpoints are gone on both nodes.
    assert _checkpoints(nodes[0]) == _checkpoints(nodes[1]) and len(_checkpoints(nodes[0])) == 2
    for node, ranks in zip(nodes, ((0, 1), (2, 3))):
        last = node / "run" / "checkpoints" / "last.ckpt"
        files = sorted(p.name for p in last.iterdir())
        assert files == [".metadata", *(f"__{r}_0.distcp" for r in ranks), "meta.pt"], files  # its own shards
        assert CheckpointReader(last).global_step == 3

    behind = tmp_path / "node1-step3.ckpt"
    shutil.copytree(nodes[1] / "run" / "checkpoints" / "last.ckpt", behind)
    resumed = _fit(zygotes, folders, nodes, tiny_dir, "--trainer.max_steps", 4, "--ckpt_path", "last")
    assert "Restoring states from the checkpoint path" in resumed.stdout + resumed.stderr
    for node in nodes:
        assert CheckpointReader(node / "run" / "checkpoints" / "last.ckpt").global_step == 4

    # The nodes' folders together are the whole checkpoint (shard names differ by rank); it equals
    # the same 4 steps on shared storage.
    merged = tmp_path / "merged.ckpt"
    shutil.copytree(nodes[0] / "run" / "checkpoints" / "last.ckpt", merged)
    for shard in (nodes[1] / "run" / "checkpoints" / "last.ckpt").glob("__*.distcp"):
        shutil.copy(shard, merged / shard.name)
    shared = folders["shared"]
    _fit(zygotes, folders, [shared, shared], tiny_dir, "--trainer.max_steps", 4)
    straight = load_training_checkpoint(shared / "run" / "checkpoints" / "last.ckpt")
    together = load_training_checkpoint(merged)
    assert straight.global_step == together.global_step == 4
    for key, value in straight.state_dict.items():
        torch.testing.assert_close(together.state_dict[key], value, atol=1e-6, rtol=1e-5, msg=key)

    # A save stopped after node 0's rename and before node 1's: node 1's last.ckpt is a step behind.
    # The ranks would resume from different steps; refused on every rank instead.
    last1 = nodes[1] / "run" / "checkpoints" / "last.ckpt"
    shutil.rmtree(last1)
    shutil.copytree(behind, last1)
    refused = _fit(zygotes, folders, nodes, tiny_dir, "--trainer.max_steps", 5, "--ckpt_path", "last", check=False)
    assert refused.returncode != 0
    assert "differs between the nodes (node 0: step 4, node 1: step 3)" in refused.stderr, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr


def test_what_node_local_storage_cannot_resume_from_is_refused_at_start(trained, folders, tiny_dir, zygotes):
    """A full checkpoint (one file rank 0 writes) on node-local storage: refused before training.
    A checkpoint to resume from that some node lacks, named or `last`: refused at resume, on every
    rank."""
    nodes = [folders["full0"], folders["full1"]]
    refused = _fit(
        zygotes, folders, nodes, tiny_dir, "--trainer.strategy.init_args.state_dict_type", "full", check=False
    )
    assert refused.returncode != 0 and "use state_dict_type: sharded" in refused.stderr, refused.stderr[-3000:]
    assert not (nodes[0] / "run" / "checkpoints" / "last.ckpt").exists()  # before any step

    shutil.copytree(trained[0] / "run" / "checkpoints" / "last.ckpt", nodes[0] / "resume.ckpt")
    refused = _fit(zygotes, folders, nodes, tiny_dir, "--ckpt_path", folders["mount"] / "resume.ckpt", check=False)
    assert refused.returncode != 0
    assert "cannot resume: checkpoint" in refused.stderr and "is missing here (node 1)" in refused.stderr

    # `--ckpt_path last` where only node 0 has the run's checkpoints (a job requeued onto other
    # machines): node 1's ranks would start from step 0 while node 0's resume (a hang).
    shutil.copytree(trained[0] / "run" / "checkpoints", nodes[0] / "run" / "checkpoints", dirs_exist_ok=True)
    refused = _fit(zygotes, folders, nodes, tiny_dir, "--ckpt_path", "last", check=False)
    assert refused.returncode != 0
    assert "others do not (node 1 finds none; node-local storage" in refused.stderr, refused.stderr[-3000:]
