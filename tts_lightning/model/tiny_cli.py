"""`tts-lightning tiny-model`: build the tiny random-weight pretrained directory (offline).

tts-lightning tiny-model runs/tiny-model                      # a Base model
tts-lightning tiny-model runs/tiny-cv --model-type custom_voice --seed 3
"""

from __future__ import annotations

import argparse
from pathlib import Path


def tiny_model_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tts-lightning tiny-model",
        description="Build a tiny random-weight Qwen3-TTS 12 Hz pretrained directory (offline).",
    )
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-type", choices=("base", "custom_voice"), default="base")
    args = parser.parse_args(argv)
    from tts_lightning.model.tiny import build_tiny_pretrained

    print(build_tiny_pretrained(args.path, seed=args.seed, model_type=args.model_type))
    return 0
