"""Regenerate the shipped demo dataset (tts_lightning/demo) with espeak-ng.

Usage: python scripts/make_demo_clips.py [--out tts_lightning/demo]

Needs the `espeak-ng` binary plus soundfile and torchaudio. Output is deterministic for a
given espeak-ng version: same text + voice + parameters give the same samples.
Not imported by the package.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio.functional as AF

SAMPLE_RATE = 24_000
MIN_SECONDS, MAX_SECONDS = 1.0, 4.0
MAX_TOTAL_BYTES = 2_000_000  # the demo ships inside the wheel; keep it small


@dataclass(frozen=True)
class Voice:
    name: str  # speaker name used in folders and the manifest
    espeak_voice: str  # -v
    pitch: int  # -p, 0-99
    speed: int  # -s, words per minute
    sentences: tuple[str, ...]


VOICES = (
    Voice(
        name="alice",
        espeak_voice="en-gb-x-rp+f3",
        pitch=65,
        speed=165,
        sentences=(
            "The morning train was late again.",
            "She planted roses along the garden wall.",
            "Please close the window before you leave.",
            "A small boat drifted slowly down the river.",
            "The library opens at nine on Saturdays.",
            "We walked home under a sky full of stars.",
            "He poured the tea and passed the biscuits round.",
            "Every leaf on the tree had turned to gold.",
            "The letter arrived three days after the party.",
            "Count the chairs and set one more place.",
            "Rain tapped gently on the kitchen roof.",
            "Our neighbour keeps bees at the end of the lane.",
        ),
    ),
    Voice(
        name="bob",
        espeak_voice="en-us",
        pitch=35,
        speed=150,
        sentences=(
            "My brother fixed the bicycle in an hour.",
            "Snow covered the mountain road by noon.",
            "The market sells fresh bread every morning.",
            "A dog barked somewhere across the valley.",
            "Check the map before we reach the coast.",
            "The soup needs a little more salt.",
            "He read the newspaper on the front porch.",
            "The lights went out during the storm.",
            "Write your name at the top of the page.",
            "The farmer counted sheep in the east field.",
            "We caught the last bus into the city.",
            "The kettle whistled while the toast burned.",
        ),
    ),
)


def espeak_version() -> str:
    out = subprocess.run(["espeak-ng", "--version"], check=True, capture_output=True, text=True).stdout
    return out.strip()


def synthesize(voice: Voice, text: str, tmp: Path) -> np.ndarray:
    """Speak `text` with espeak-ng, return mono int16 samples at 24 kHz."""
    wav = tmp / "out.wav"
    subprocess.run(
        ["espeak-ng", "-v", voice.espeak_voice, "-p", str(voice.pitch), "-s", str(voice.speed), "-w", str(wav), text],
        check=True,
    )
    samples, rate = sf.read(wav, dtype="float32", always_2d=True)
    wave = torch.from_numpy(samples.T.copy()).mean(dim=0)
    wave = AF.resample(wave, rate, SAMPLE_RATE)
    return (wave.clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tts_lightning" / "demo")
    args = parser.parse_args()
    if shutil.which("espeak-ng") is None:
        raise SystemExit("espeak-ng is not installed (apt-get install espeak-ng)")

    clips_dir = args.out / "clips"
    if clips_dir.exists():
        shutil.rmtree(clips_dir)  # start clean so removed sentences leave no stale files
    lines: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for voice in VOICES:
            speaker_dir = clips_dir / voice.name
            speaker_dir.mkdir(parents=True)
            ref = f"clips/{voice.name}/{voice.name}_000.flac"  # first clip is the fixed reference
            for i, text in enumerate(voice.sentences):
                clip_id = f"{voice.name}_{i:03d}"
                samples = synthesize(voice, text, Path(tmp))
                seconds = len(samples) / SAMPLE_RATE
                if not MIN_SECONDS <= seconds <= MAX_SECONDS:
                    raise SystemExit(f"{clip_id} is {seconds:.2f} s, outside {MIN_SECONDS}-{MAX_SECONDS} s: {text!r}")
                sf.write(speaker_dir / f"{clip_id}.flac", samples, SAMPLE_RATE, subtype="PCM_16")
                (speaker_dir / f"{clip_id}.txt").write_text(text + "\n", encoding="utf-8")
                lines.append(
                    {
                        "audio": f"clips/{voice.name}/{clip_id}.flac",
                        "text": text,
                        "ref_audio": ref,
                        "speaker": voice.name,
                        "language": "english",
                    }
                )
                print(f"{clip_id}  {seconds:.2f} s  {text}")
    with (args.out / "train.jsonl").open("w", encoding="utf-8") as fh:
        for line in lines:
            fh.write(json.dumps(line, ensure_ascii=False) + "\n")
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    if total > MAX_TOTAL_BYTES:
        raise SystemExit(f"demo is {total} bytes, over the {MAX_TOTAL_BYTES} byte budget: drop or shorten sentences")
    print(f"wrote {len(lines)} clips ({total} bytes) with {espeak_version()}")


if __name__ == "__main__":
    main()
