"""Names that moved keep working from their old path for one release, with a FutureWarning."""

import importlib

import pytest


@pytest.mark.parametrize(
    ("old_module", "name", "new_module", "new_name"),
    [
        ("tts_lightning.model.module", "matches", "tts_lightning.model.parameters", "matches"),
        ("tts_lightning.model.module", "DEFAULT_FREEZE", "tts_lightning.model.parameters", "DEFAULT_FREEZE"),
        ("tts_lightning.model.tiny", "default_cache_dir", "tts_lightning.model.tiny", "tiny_cache_dir"),
    ],
)
def test_old_path_warns_and_gives_the_moved_object(old_module, name, new_module, new_name):
    with pytest.warns(FutureWarning, match=f"{old_module}.{name} moved to {new_module}.{new_name}"):
        old = getattr(importlib.import_module(old_module), name)
    assert old is getattr(importlib.import_module(new_module), new_name)


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        importlib.import_module("tts_lightning.model.module").not_a_name
