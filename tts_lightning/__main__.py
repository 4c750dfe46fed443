"""The `tts-lightning` command: LightningCLI subcommands plus the project's own tools."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")


def _tiny_model(argv: list[str]) -> int:
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


def _synthesize(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tts-lightning synthesize",
        description=(
            "Speak texts with a custom_voice model (--speaker) or clone a voice with a base model (--ref-audio)."
        ),
    )
    parser.add_argument("--model", required=True, help="model directory (exported, pretrained or tiny)")
    parser.add_argument("--text", action="append", default=[], help="text to speak; repeat for several")
    parser.add_argument("--text-file", type=Path, help="one text per line")
    parser.add_argument("--speaker", help="speaker name of a custom_voice model")
    parser.add_argument("--ref-audio", type=Path, help="reference clip for a base model")
    parser.add_argument("--language", default="Auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--out", type=Path, required=True, help="output .wav (one text) or folder (several texts)")
    args = parser.parse_args(argv)
    texts = list(args.text)
    if args.text_file:
        texts += [t.strip() for t in args.text_file.read_text().splitlines() if t.strip()]
    if not texts:
        parser.error("give --text or --text-file")

    import soundfile as sf

    from tts_lightning.model.synthesis import synthesize

    wavs, sr = synthesize(
        args.model,
        texts,
        speaker=args.speaker,
        ref_audio=args.ref_audio,
        language=args.language,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
    )
    if len(wavs) == 1 and args.out.suffix.lower() == ".wav":
        outs = [args.out]
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        outs = [args.out / f"{i:03d}.wav" for i in range(len(wavs))]
    for wav, out in zip(wavs, outs):
        out.parent.mkdir(parents=True, exist_ok=True)
        sf.write(str(out), wav, sr)
        print(f"{out}  {len(wav) / sr:.2f} s")
    return 0


def _export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tts-lightning export",
        description="Export a training checkpoint (full file or sharded folder) to a qwen-tts custom_voice directory.",
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
    args = parser.parse_args(argv)
    from tts_lightning.model.checkpoint import CheckpointError
    from tts_lightning.model.export import ExportError, export_adapter, export_custom_voice
    from tts_lightning.model.pretrained import PretrainedError

    try:
        if args.adapter_only:
            out = export_adapter(
                args.ckpt,
                args.out,
                pretrained=args.pretrained,
                overwrite=args.overwrite,
                trust_checkpoint=args.trust_checkpoint,
            )
        else:
            out = export_custom_voice(
                args.ckpt,
                args.out,
                dtype=args.dtype,
                pretrained=args.pretrained,
                overwrite=args.overwrite,
                trust_checkpoint=args.trust_checkpoint,
            )
    except (ExportError, CheckpointError, PretrainedError) as exc:
        print(f"tts-lightning export: error: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


def _prepare(argv: list[str]) -> int:
    from tts_lightning.data.prepare_cli import prepare_command

    return prepare_command(argv)


def _plan(argv: list[str]) -> int:
    from tts_lightning.distributed.plan_cli import plan_command

    return plan_command(argv)


def _ray_fit(argv: list[str]) -> int:
    from tts_lightning.distributed.ray_cli import ray_fit_command

    return ray_fit_command(argv)


def _evaluate(argv: list[str]) -> int:
    from tts_lightning.evaluation.cli import evaluate_command

    return evaluate_command(argv)


TOOLS = {
    "tiny-model": _tiny_model,
    "prepare": _prepare,
    "export": _export,
    "synthesize": _synthesize,
    "plan": _plan,
    "ray-fit": _ray_fit,
    "evaluate": _evaluate,
}


def main(argv: list[str] | None = None) -> int:
    from tts_lightning import console

    console.install()  # known third-party noise off the console (see tts_lightning/console.py)
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    from tts_lightning.files import WriteError

    if argv and argv[0] in TOOLS:
        try:
            return TOOLS[argv[0]](argv[1:])
        except WriteError as exc:  # disk full, quota, permissions: one message, no traceback
            print(f"tts-lightning {argv[0]}: error: {exc}", file=sys.stderr)
            return 1
    if argv and argv[0] in LIGHTNING_COMMANDS:
        from tts_lightning.cli import cli_main

        try:
            # From the command line LightningCLI reads sys.argv itself (given args, it warns that
            # they are meant for calls from Python).
            cli_main(None if from_command_line else argv)
        except WriteError as exc:  # Lightning has already stopped the other processes
            print(f"tts-lightning {argv[0]}: error: {exc}", file=sys.stderr)
            return 1
        return 0
    commands = ", ".join([*LIGHTNING_COMMANDS, *TOOLS])
    print(f"usage: tts-lightning {{{commands}}} ...", file=sys.stderr)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main())
