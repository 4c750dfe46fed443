"""`evaluate --held-out`'s pairing: with the fine-tuned weights equal to the start (the tiny base
model against itself), "after" clones exactly what "before" cloned, sample for sample, through the
official ICL path, and the report says so (Δ = 0, within noise)."""

import numpy as np
import pytest
import soundfile as sf
import torch

from tts_lightning.evaluation.zero_shot import clone_before_after, read_held_out, zero_shot_result

TEXT = "Good morning to you."


@pytest.mark.slow  # two tiny-model loads, 4 generations through the official ICL path
def test_unchanged_weights_clone_the_same_before_and_after(tiny_dir, held_out_manifest, tmp_path):
    torch.set_num_threads(1)
    (plan,) = read_held_out(held_out_manifest, ["alice", "bob"])
    assert plan.name == "dave" and plan.reference.name == "dave_000.wav" and plan.reference_text
    assert [a.name for a, _ in plan.real_clips] == ["dave_001.wav"] and plan.held_out
    plan.texts = [TEXT]
    cloned = clone_before_after(
        tiny_dir,
        tiny_dir,
        [plan],
        device="cpu",
        torch_dtype=torch.float32,
        num_samples=2,
        seed=0,
        limit_factor=3.0,
        audio_dir=tmp_path,
    )
    generated = cloned[0]
    before, after = generated["before"]["dave"], generated["after"]["dave"]
    assert [g["seed"] for g in before] == [g["seed"] for g in after] == [0, 1000]
    for b, a in zip(before, after, strict=True):
        assert "zero_shot_before" in b["audio"] and "zero_shot_after" in a["audio"]
        wav_b, wav_a = sf.read(b["audio"])[0], sf.read(a["audio"])[0]
        assert wav_b.size > 0 and np.array_equal(wav_b, wav_a) and b["frames"] == a["frames"]
    assert not np.array_equal(sf.read(before[0]["audio"])[0], sf.read(before[1]["audio"])[0])  # seeds differ

    section = zero_shot_result(held_out_manifest, [plan], *cloned, alpha=0.05)
    dave = section["speakers"]["dave"]
    sims = {w: [g["similarity"] for g in dave["generations"][w]] for w in ("before", "after")}
    assert sims["before"] == sims["after"] and all(-1.0 <= s <= 1.0 for s in sims["before"])
    assert dave["summary"]["before"]["speaker_similarity"] == dave["summary"]["after"]["speaker_similarity"]
    c = dave["comparison"]["speaker_similarity"]
    assert c["difference"] == 0.0 and c["verdict"] == "within noise" and c["pairs"] == 2 and c["p_value"] == 1.0


@pytest.mark.parametrize("nested", [True, False])
def test_held_out_clips_from_a_folder(held_out_manifest, tmp_path, nested):
    """A folder of clips with .txt transcripts (a sub-folder per speaker, else speaker "held_out"); a
    speaker with one clip is scored against its reference."""
    import shutil

    folder = tmp_path / "clips" / ("erin" if nested else "")
    folder.mkdir(parents=True)
    shutil.copy(held_out_manifest.parent / "dave_000.wav", folder / "one.wav")
    (folder / "one.txt").write_text("My brother fixed the bicycle in an hour.\n")
    (plan,) = read_held_out(tmp_path / "clips", ["alice", "bob"])
    assert plan.name == ("erin" if nested else "held_out") and plan.reference == folder / "one.wav"
    assert plan.reference_text == "My brother fixed the bicycle in an hour."
    assert plan.real_clips == [(folder / "one.wav", plan.reference_text)] and not plan.held_out
