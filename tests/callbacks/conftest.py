"""The demo speakers prepared once for the callback tests, with the settings of
configs/tiny-cpu.yaml, so that the FSDP CLI run reuses the same cache instead of encoding again."""

import shutil

import pytest

from tts_lightning.data.demo import demo_dir


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory, tiny_dir):
    from tts_lightning import SpeakerClipsDataModule

    root = tmp_path_factory.mktemp("samples")
    shutil.copytree(demo_dir(), root / "demo", ignore=shutil.ignore_patterns(".*"))
    manifest, cache = root / "demo" / "train.jsonl", root / "cache"
    SpeakerClipsDataModule(str(tiny_dir), str(manifest), val_fraction=0.15, cache_dir=str(cache), seed=0,
                           max_frames_per_batch=150).prepare()
    return root, manifest, cache


@pytest.fixture
def make_datamodule(tiny_dir, demo_data):
    """make_datamodule(**kwargs): a SpeakerClipsDataModule on the prepared demo data."""
    from tts_lightning import SpeakerClipsDataModule

    _, manifest, cache = demo_data

    def make(**kwargs):
        kwargs.setdefault("max_frames_per_batch", 150)
        return SpeakerClipsDataModule(str(tiny_dir), str(manifest), val_fraction=0.15, cache_dir=str(cache),
                                      seed=0, **kwargs)

    return make
