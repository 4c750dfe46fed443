"""The data module's helpers that moved to `tts_lightning.data.prepare` keep working from their old
path for one release, with a FutureWarning naming the new one."""

from __future__ import annotations

import importlib
import warnings

import pytest

MOVED = [
    ("default_cache_dir", "tts_lightning.data.prepare"),
    ("split_validation", "tts_lightning.data.prepare"),
    ("validate_with_memo", "tts_lightning.data.prepare"),
    ("load_codes_shape", "tts_lightning.data.prepare"),
    ("PREPARED_VERSION", "tts_lightning.data.prepare"),
    ("VALIDATION_MEMO_VERSION", "tts_lightning.data.prepare"),
    ("CACHE_DIR_NAME", "tts_lightning.data.prepare"),
]


@pytest.mark.parametrize(("name", "new_module"), MOVED)
def test_old_datamodule_path_warns_and_resolves(name, new_module):
    old = importlib.import_module("tts_lightning.data.datamodule")
    with pytest.warns(FutureWarning, match=rf"tts_lightning\.data\.datamodule\.{name} moved to {new_module}\.{name}"):
        value = getattr(old, name)
    assert value is getattr(importlib.import_module(new_module), name)


def test_from_import_warns_and_what_stayed_does_not():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from tts_lightning.data.datamodule import SpeakerClipsDataModule  # noqa: F401  (still lives there)
    with pytest.warns(FutureWarning, match="default_cache_dir moved"):
        from tts_lightning.data.datamodule import default_cache_dir
    from tts_lightning.data.prepare import default_cache_dir as new

    assert default_cache_dir is new
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        importlib.import_module("tts_lightning.data.datamodule").nope  # noqa: B018
