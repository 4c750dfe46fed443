"""Starting from a custom_voice model: speaker rows, their ids, what is refused (single process)."""

import json
import shutil

import pytest
import torch

from tts_lightning import Qwen3TTSModule
from tts_lightning.errors import ConfigError
from tts_lightning.model.custom_voice import CODEC_EMBEDDING_KEY, speaker_codec_ids
from tts_lightning.model.pretrained import PretrainedError, check_pretrained, load_state_dict


def test_new_speakers_collide_with_nothing(tiny_custom_voice_dir):
    talker = check_pretrained(tiny_custom_voice_dir).config["talker_config"]
    built_in = talker["spk_id"]
    assert sorted(built_in) == ["ryan", "serena", "vivian"]
    ids = speaker_codec_ids(talker, ["alice", "Vivian", "bob", "RYAN"])
    assert ids[1] == built_in["vivian"] and ids[3] == built_in["ryan"]
    taken = {v for k, v in talker.items() if k.startswith("codec_") and isinstance(v, int)}
    taken |= set(talker["codec_language_id"].values()) | set(built_in.values())
    assert ids[0] != ids[2] and not {ids[0], ids[2]} & taken
    assert all(talker["vocab_size"] - 1024 <= i < talker["vocab_size"] for i in ids)
    # Any order of the same speakers gives each name the same row.
    assert speaker_codec_ids(talker, ["bob", "RYAN", "alice", "Vivian"]) == [ids[2], ids[3], ids[0], ids[1]]


def test_new_speaker_ids_go_past_72_into_every_id_generation_never_emits(tiny_custom_voice_dir):
    """The first 72 where the official recipe puts them (vocab - 72, ...); then the rest of the
    input-only ids: a VCTK-sized run (109 speakers) exports with a row each."""
    from tts_lightning.errors import UserError
    from tts_lightning.model.custom_voice import new_speaker_ids

    talker = check_pretrained(tiny_custom_voice_dir).config["talker_config"]
    vocab = talker["vocab_size"]
    taken = {v for k, v in talker.items() if k.startswith("codec_") and isinstance(v, int)}
    taken |= set(talker["codec_language_id"].values()) | set(talker["spk_id"].values())
    ids = new_speaker_ids(talker, 109)
    assert len(set(ids)) == 109 and not set(ids) & taken
    assert all(vocab - 1024 <= i < vocab for i in ids)
    assert ids[:10] == [i for i in range(vocab - 72, vocab) if i not in taken][:10]  # as before
    free = 1024 - len(taken & set(range(vocab - 1024, vocab)))
    assert len(new_speaker_ids(talker, free)) == free
    with pytest.raises(UserError, match=f"{free + 1} new speakers, but the model has {free} free speaker ids"):
        new_speaker_ids(talker, free + 1)


def test_module_starts_new_rows_from_the_built_in_ones(tiny_custom_voice_dir):
    module = Qwen3TTSModule(str(tiny_custom_voice_dir), speakers=["alice", "Vivian"])
    module.configure_model()
    info = check_pretrained(tiny_custom_voice_dir)
    start = load_state_dict(info, prefix=CODEC_EMBEDDING_KEY)[CODEC_EMBEDDING_KEY]
    rows = module.talker.get_input_embeddings().weight.detach()
    alice, vivian = module.hparams["speaker_codec_ids"]
    built_in = sorted(info.speakers.values())
    torch.testing.assert_close(rows[alice], start[built_in].mean(0), rtol=0, atol=1e-6)
    assert torch.equal(rows[vivian], start[vivian]) and vivian == info.speakers["vivian"]
    others = torch.ones(len(rows), dtype=torch.bool)
    others[alice] = False
    assert torch.equal(rows[others], start[others])  # nothing else moved
    assert module.model.speaker_encoder is None  # a custom_voice model has none
    # predict_step speaks with the rows themselves (what spk_id selects once exported).
    module.eval()
    out = module.predict_step({"text": ["Hello.", "Hello."], "speaker": ["alice", "Vivian"]}, 0)
    assert [r["speaker"] for r in out] == ["alice", "Vivian"]
    assert all(r["codes"].shape[1] == 16 and r["audio"].size > 0 for r in out)


def test_what_is_not_offered(tiny_custom_voice_dir, tmp_path):
    with pytest.raises(ConfigError, match="LoRA is not offered from a custom_voice model"):
        Qwen3TTSModule(str(tiny_custom_voice_dir), speakers=["alice"], adapter={"rank": 4})
    with pytest.raises(ConfigError, match="clash after lower-casing"):
        Qwen3TTSModule(str(tiny_custom_voice_dir), speakers=["alice", "Alice"])
    design = tmp_path / "design"
    shutil.copytree(tiny_custom_voice_dir, design)
    config = json.loads((design / "config.json").read_text())
    (design / "config.json").write_text(json.dumps({**config, "tts_model_type": "voice_design"}))
    with pytest.raises(PretrainedError, match=r"'voice_design', but one of \('base', 'custom_voice'\) is required"):
        Qwen3TTSModule(str(design))


def test_instructs_need_a_custom_voice_model(tiny_dir, tmp_path):
    from tts_lightning import SpeakerClipsDataModule
    from tts_lightning.data.demo import demo_dir

    src = demo_dir() / "clips" / "alice" / "alice_000"
    shutil.copy(src.with_suffix(".flac"), tmp_path / "a.flac")
    record = {"audio": "a.flac", "text": src.with_suffix(".txt").read_text().strip(), "instruct": "Slowly."}
    (tmp_path / "train.jsonl").write_text(json.dumps(record) + "\n")
    data = SpeakerClipsDataModule(str(tiny_dir), str(tmp_path / "train.jsonl"), val_fraction=0.0)
    with pytest.raises(ConfigError, match=r"train.jsonl:1: 'instruct' needs a custom_voice model as data.pretrained"):
        data.prepare_data()


def test_instructs_are_refused_where_generation_drops_them(tiny_custom_voice_dir, tmp_path):
    """The 0.6B CustomVoice (tts_model_size "0b6"): generate_custom_voice ignores instructs."""
    from tts_lightning import SpeakerClipsDataModule
    from tts_lightning.data.demo import demo_dir

    small = shutil.copytree(tiny_custom_voice_dir, tmp_path / "0b6")
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "tts_model_size": "0b6"}))
    src = demo_dir() / "clips" / "alice" / "alice_000"
    shutil.copy(src.with_suffix(".flac"), tmp_path / "a.flac")
    record = {"audio": "a.flac", "text": src.with_suffix(".txt").read_text().strip(), "instruct": "Slowly."}
    (tmp_path / "train.jsonl").write_text(json.dumps(record) + "\n")
    data = SpeakerClipsDataModule(str(small), str(tmp_path / "train.jsonl"), val_fraction=0.0)
    with pytest.raises(ConfigError, match=r"'instruct' is ignored by .*tts_model_size '0b6'"):
        data.prepare_data()


def test_decay_groups_need_the_codec_embedding_by_name():
    """FSDP1 with ``use_orig_params: false`` names only flat parameters: refused, not decayed."""
    from tts_lightning.model.custom_voice import without_decay_of_codec_embedding

    rows, other = torch.nn.Parameter(torch.zeros(4, 2)), torch.nn.Parameter(torch.zeros(2))
    named = [(f"model._fsdp_wrapped_module.{CODEC_EMBEDDING_KEY}", rows), ("model.talker.codec_head.weight", other)]
    decayed, kept = without_decay_of_codec_embedding(named)
    assert decayed["params"] == [other] and kept == {"params": [rows], "weight_decay": 0.0}
    with pytest.raises(ConfigError, match="use_orig_params: true"):
        without_decay_of_codec_embedding([("model._fsdp_wrapped_module._flat_param", other)])
