"""`tts-lightning export`: a training checkpoint to a qwen-tts custom_voice directory
(`tts_lightning.model.export`), or a LoRA run's adapter alone in peft's format.

    tts-lightning export --ckpt runs/tiny-cpu/checkpoints/last.ckpt --out runs/voice
    tts-lightning export --ckpt CKPT --out adapter/ --adapter-only
    tts-lightning export --ckpt CKPT --out voice/ --model-type base   # the default for an ICL-trained run
"""

from __future__ import annotations

import argparse
from pathlib import Path


def export_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tts-lightning export",
        description="Export a training checkpoint (full file or sharded folder) to a qwen-tts custom_voice "
        "(or base) directory.",
    )
    parser.add_argument("--ckpt", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16")
    parser.add_argument("--pretrained", help="base directory (default: the one the run trained from)")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="unpickle everything in the checkpoint (can run code: only for a file you trust)",
    )
    parser.add_argument(
        "--adapter-only",
        action="store_true",
        help="LoRA runs: write only the adapter in peft's format (plus the speaker table) "
        "instead of the merged custom_voice model",
    )
    parser.add_argument(
        "--model-type",
        choices=("auto", "custom_voice", "base"),
        default="auto",
        help="custom_voice (named speakers, generate_custom_voice) or base (generate_voice_clone with a "
        "reference clip); auto: base for a run trained with data.layout icl, else custom_voice",
    )
    args = parser.parse_args(argv)
    from tts_lightning.files import recover_beside
    from tts_lightning.model.export import export_adapter, export_base, export_custom_voice, trained_layout

    recover_beside(Path(args.out))  # what a killed export left

    if args.adapter_only:
        out = export_adapter(
            args.ckpt,
            args.out,
            pretrained=args.pretrained,
            overwrite=args.overwrite,
            trust_checkpoint=args.trust_checkpoint,
        )
    elif args.model_type == "base" or (
        args.model_type == "auto" and trained_layout(args.ckpt, trust_checkpoint=args.trust_checkpoint) == "icl"
    ):
        out = export_base(args.ckpt, args.out, **_model_options(args))
    else:
        out = export_custom_voice(args.ckpt, args.out, **_model_options(args))
    print(out)
    return 0


def _model_options(args) -> dict:
    """The options `export_base` and `export_custom_voice` share."""
    return {
        "dtype": args.dtype,
        "pretrained": args.pretrained,
        "overwrite": args.overwrite,
        "trust_checkpoint": args.trust_checkpoint,
    }
