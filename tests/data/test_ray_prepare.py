"""`tts-lightning prepare --ray.num_workers 2`: the codes encoded by 2 Ray Data CPU workers are the
bytes a single process writes."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from tts_lightning.data.datamodule import SpeakerClipsDataModule
from tts_lightning.data.demo import demo_dir
from tts_lightning.data.prepare_cli import prepare_command

pytestmark = pytest.mark.slow


def _codes(cache: Path) -> dict[str, bytes]:
    return {p.relative_to(cache).as_posix(): p.read_bytes() for p in cache.glob("codes/*/*.npy")}


def test_ray_workers_write_the_same_codes_as_one_process(tiny_dir, tmp_path, capsys):
    shutil.copytree(demo_dir(), tmp_path / "demo", ignore=shutil.ignore_patterns(".*"))
    manifest = tmp_path / "demo" / "train.jsonl"
    flags = ["--pretrained", str(tiny_dir), "--train_manifest", str(manifest), "--max_frames_per_batch", "400"]
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    try:
        assert prepare_command([*flags, "--cache_dir", str(tmp_path / "ray"), "--ray.num_workers", "2"]) == 0
    finally:
        logging.getLogger("lightning.pytorch.utilities.rank_zero").removeHandler(handler)
    assert "accepted 24 clips" in capsys.readouterr().out
    assert any(line.startswith("codec cache: 24 clip(s) encoded on 2 Ray worker(s)") for line in lines), lines

    SpeakerClipsDataModule(
        str(tiny_dir), str(manifest), cache_dir=str(tmp_path / "serial"), max_frames_per_batch=400
    ).prepare()
    ray, serial = _codes(tmp_path / "ray"), _codes(tmp_path / "serial")
    assert len(serial) == 24 and ray.keys() == serial.keys()
    assert [p for p in serial if ray[p] != serial[p]] == []
    assert (tmp_path / "ray" / "prepared.json").read_bytes() == (tmp_path / "serial" / "prepared.json").read_bytes()


def test_gpu_encoding_actors_ask_ray_for_a_gpu_each():
    """A CUDA prepare device: each actor asks Ray for one GPU and encodes on the one Ray gives it
    (``cuda``, its only visible device); CPU work asks for none. No device: decided once from the
    cluster's GPUs, as `prepare` decides on one machine, so no actor picks GPU 0 by itself (the
    CPU-only cluster of the test above encodes on the CPU)."""
    from tts_lightning.data.ray_prepare import actor_device

    assert actor_device("cuda:3") == (1.0, "cuda")
    assert actor_device("cuda") == (1.0, "cuda")
    assert actor_device("cpu") == (0.0, "cpu")
    assert actor_device(None, cuda_available=True) == (1.0, "cuda")
    assert actor_device(None, cuda_available=False) == (0.0, "cpu")


def test_workers_load_the_drivers_model_folder_where_their_node_has_it(tmp_path):
    """On several nodes the driver's resolved folder (its Hugging Face cache, its user cache) is on
    the driver's disk: a worker whose node lacks it resolves the name the user gave on its own."""
    from tts_lightning.data.ray_prepare import worker_pretrained

    assert worker_pretrained(str(tmp_path), "Qwen/Qwen3-TTS-12Hz-1.7B-Base") == str(tmp_path)
    elsewhere = str(tmp_path / "hub" / "snapshots" / "abc")  # not on this node
    assert worker_pretrained(elsewhere, "Qwen/Qwen3-TTS-12Hz-1.7B-Base") == "Qwen/Qwen3-TTS-12Hz-1.7B-Base"
    assert worker_pretrained(elsewhere, "tiny") == "tiny"
