"""Held-out clips for `evaluate --held-out`: a speaker no run of the suite trains on."""

import json

import pytest

HELD_OUT = "dave"


@pytest.fixture(scope="session")
def held_out_manifest(tmp_path_factory):
    """Two clips of "dave", a voice not in the demo data: two of bob's sentences sped up by 1.25
    (pitch and pace up a third; resampled, then read at the original rate), in a Qwen3-TTS JSONL."""
    import soundfile as sf
    import torch
    import torchaudio.functional as AF

    from tts_lightning.data.demo import demo_dir

    root = tmp_path_factory.mktemp("held_out")
    lines = []
    for i in range(2):
        clip = demo_dir() / "clips" / "bob" / f"bob_{i:03d}"
        wav, sr = sf.read(clip.with_suffix(".flac"), dtype="float32")
        faster = AF.resample(torch.from_numpy(wav), sr, sr * 4 // 5).numpy()
        sf.write(root / f"{HELD_OUT}_{i:03d}.wav", faster, sr)
        text = clip.with_suffix(".txt").read_text().strip()
        lines.append({"audio": f"{HELD_OUT}_{i:03d}.wav", "text": text, "speaker": HELD_OUT, "language": "english"})
    manifest = root / "held_out.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return manifest
