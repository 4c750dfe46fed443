"""Export the seeded 2-rank FSDP fine-tuning of the two demo speakers from its sharded and from a
consolidated full checkpoint, and speak with the result through the official `qwen_tts.Qwen3TTSModel`."""

import pytest
import torch
from safetensors.torch import load_file
from tiny_runs import newest_last

from tts_lightning.model.checkpoint import CheckpointError, load_training_checkpoint
from tts_lightning.model.export import ExportError, export_custom_voice
from tts_lightning.model.row_blocks import DEFAULT_TEXT_EMBEDDING_BLOCKS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, fsdp1_reference, run_script):
    """The sharded `last.ckpt` of the session's seeded 2-rank FSDP1 run (conftest.py of this folder)
    and its consolidation into one full checkpoint by Lightning's own tool."""
    root = tmp_path_factory.mktemp("export")
    sharded = newest_last(fsdp1_reference[0])
    assert sharded.is_dir() and len(list(sharded.glob("*.distcp"))) == 2  # one shard per rank
    full = root / "full.ckpt"
    run_script("-m", "lightning.pytorch.utilities.consolidate_checkpoint", sharded, "--output_file", full, timeout=300)
    return root, sharded, full


@pytest.mark.parametrize("source, dtype", [("sharded", "fp32"), ("full", "bf16")])
def test_round_trip(checkpoints, source, dtype):
    root, sharded, full = checkpoints
    ckpt_path = sharded if source == "sharded" else full
    out = export_custom_voice(ckpt_path, root / f"voice-{source}", dtype=dtype)
    checkpoint = load_training_checkpoint(ckpt_path)

    from qwen_tts import Qwen3TTSModel

    model = Qwen3TTSModel.from_pretrained(str(out))
    assert set(model.get_supported_speakers()) == {"alice", "bob"}
    torch.manual_seed(0)
    wavs, sr = model.generate_custom_voice(text="Hello there.", speaker="alice")
    assert sr == 24_000 and wavs[0].ndim == 1 and wavs[0].size > 0

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    exported = load_file(str(out / "model.safetensors"))
    spk_id = model.model.config.talker_config.spk_id
    table = exported["talker.model.codec_embedding.weight"]
    embeddings = checkpoint.state_dict["speaker_embeddings"]
    assert embeddings.dtype == torch.float32 and embeddings.abs().sum() > 0
    for i, name in enumerate(["alice", "bob"]):
        assert spk_id[name] >= 3000 - 3072 + table.shape[0]  # the 3000, 3001, ... block
        torch.testing.assert_close(table[spk_id[name]], embeddings[i].to(torch_dtype), atol=0, rtol=0)
    weights = checkpoint.model_state_dict()
    # the run's text embedding is stored as row blocks (tts_lightning.model.row_blocks), exported as
    # the official tensor (compared with the joined blocks below)
    if source == "sharded":
        from torch.distributed.checkpoint import FileSystemReader

        stored = FileSystemReader(str(sharded)).read_metadata().state_dict_metadata
        blocks = [k for k in stored if k.startswith("model.") and ".text_embedding.blocks." in k]
        assert len(blocks) == DEFAULT_TEXT_EMBEDDING_BLOCKS
    assert exported["talker.model.text_embedding.weight"].shape[0] == model.model.config.talker_config.text_vocab_size
    assert not any(".blocks." in k for k in exported if "text_embedding" in k)
    assert not any(k.startswith("speaker_encoder.") for k in exported)
    assert set(exported) == {k for k in weights if not k.startswith("speaker_encoder.")}
    rows = torch.ones(table.shape[0], dtype=torch.bool)
    rows[[spk_id["alice"], spk_id["bob"]]] = False
    for key, value in exported.items():
        expected = weights[key].to(torch_dtype)
        if key == "talker.model.codec_embedding.weight":
            value, expected = value[rows], expected[rows]
        torch.testing.assert_close(value, expected, atol=0, rtol=0, msg=key)


def test_clashing_name_is_refused_and_leaves_nothing(checkpoints, tiny_custom_voice_dir, tmp_path):
    root, _, full = checkpoints
    raw = torch.load(full, weights_only=False)
    raw["hyper_parameters"]["speakers"] = ["Vivian", "bob"]  # vivian is built into the base
    clashing = tmp_path / "clash.ckpt"
    torch.save(raw, clashing)
    with pytest.raises(ExportError, match=r"\['vivian'\] already exist"):
        export_custom_voice(clashing, tmp_path / "out", pretrained=tiny_custom_voice_dir)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [clashing]


def test_missing_and_corrupt_checkpoints(tmp_path, run_cli):
    with pytest.raises(CheckpointError, match="does not exist"):
        export_custom_voice(tmp_path / "nope.ckpt", tmp_path / "out")
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(b"PK\x03\x04 not really a checkpoint")  # a zip's start, cut short
    with pytest.raises(CheckpointError, match="is not a checkpoint .*: another format, or cut short"):
        export_custom_voice(corrupt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    proc = run_cli("export", "--ckpt", corrupt, "--out", tmp_path / "out", cwd=tmp_path, check=False, timeout=300)
    assert proc.returncode == 2 and "corrupt.ckpt" in proc.stderr and not (tmp_path / "out").exists()


def test_sharded_export_streams_model_tensors_only(checkpoints, tmp_path, monkeypatch):
    """Export reads the model's tensors from the DCP files and never an optimizer entry, and
    writes safetensors shards (with an index) that qwen_tts loads to the same weights."""
    from torch.distributed.checkpoint import FileSystemReader

    root, sharded, _ = checkpoints
    read: list[str] = []
    real = FileSystemReader.read_data

    def spy(self, plan, planner):  # records what is read, then reads it
        read.extend(item.storage_index.fqn for item in plan.items)
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", spy)
    out = export_custom_voice(sharded, tmp_path / "voice", dtype="fp32", max_shard_size=400_000)
    monkeypatch.undo()
    assert read and all(fqn.startswith("model.") for fqn in read), sorted(set(read))[:5]
    assert not any(fqn.startswith("optimizer") for fqn in read)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    single = export_custom_voice(sharded, tmp_path / "single", dtype="fp32")
    expected = load_file(str(single / "model.safetensors"))
    got = {k: v for shard in shards for k, v in load_file(str(shard)).items()}
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)

    from qwen_tts import Qwen3TTSModel

    model = Qwen3TTSModel.from_pretrained(str(out))
    loaded = model.model.state_dict()
    assert all(torch.equal(loaded[k].float(), expected[k]) for k in expected)
