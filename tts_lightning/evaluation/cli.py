"""The `tts-lightning evaluate` command."""

from __future__ import annotations

import argparse
from pathlib import Path


def _prepared_from_config(config: Path) -> Path:
    """The cache folder of a training config's data (``data.cache_dir``, else the manifest's default)."""
    from tts_lightning.data.prepare import default_cache_dir
    from tts_lightning.data.prepare_cli import data_section
    from tts_lightning.evaluation.inputs import EvaluationError

    data = data_section(config)
    if data.get("cache_dir"):
        return Path(data["cache_dir"])
    if not data.get("train_manifest"):
        raise EvaluationError(f"{config} names no data.train_manifest: pass --prepared")
    return default_cache_dir(data["train_manifest"])


def evaluate_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tts-lightning evaluate",
        description="Did fine-tuning help? Speak held-out texts with the fine-tuned model and with the base "
        "model's zero-shot cloning (x-vector and ICL) from the same reference; score speaker "
        "similarity, speaking rate and end-of-speech failures; write evaluation.json, "
        "evaluation.md and the audio.",
    )
    parser.add_argument(
        "--model",
        required=True,
        help="the fine-tuned model: an exported directory or a training checkpoint (file or sharded folder)",
    )
    parser.add_argument("--base", help="the base model (default: the one a training checkpoint names)")
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--config", type=Path, help="the training config (its data's prepared cache is used)")
    data.add_argument("--prepared", type=Path, help="the prepared data: data.cache_dir or its prepared.json")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--speaker", action="append", default=[], help="speaker to evaluate (repeat; default all)")
    parser.add_argument(
        "--text",
        action="append",
        default=[],
        help="text to speak (repeat; default each speaker's validation transcripts, else built-in sentences)",
    )
    parser.add_argument("--text-file", type=Path, help="one text per line")
    parser.add_argument("--max-texts", type=int, default=4, help="at most this many texts per speaker")
    parser.add_argument("--num-samples", type=int, default=2, help="seeded samples per text (for the spread)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--limit-factor",
        type=float,
        default=3.0,
        help="a generation fails to end when it runs past this many times the speaker's time for the text",
    )
    parser.add_argument(
        "--alpha",
        type=float,
        default=0.05,
        help="significance level: a verdict is better / worse only when the paired test's p is below it",
    )
    parser.add_argument(
        "--asr",
        help="score intelligibility (CER, WER against the text) with this recognizer: a Whisper checkpoint "
        "(openai/whisper-small or a local folder) or pocketsphinx (offline, weak); default off",
    )
    parser.add_argument("--no-icl", action="store_true", help="skip the zero-shot ICL system")
    parser.add_argument(
        "--held-out",
        type=Path,
        help="clips of speakers not in the run's data (a .jsonl, metadata.csv or folder manifest): each "
        "speaker's first clip is cloned (ICL) by the base model and by the fine-tuned weights, before / after",
    )
    parser.add_argument("--device", help="default cuda:0 when available, else cpu")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default bf16 on a GPU, fp32 on the CPU")
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="unpickle everything in the checkpoint (can run code: only for a file you trust)",
    )
    args = parser.parse_args(argv)
    from tts_lightning.evaluation.evaluate import evaluate
    from tts_lightning.model.synthesis import read_text_file

    texts = list(args.text)
    if args.text_file:
        texts += read_text_file(args.text_file, "--text-file")
    prepared = args.prepared if args.prepared is not None else _prepared_from_config(args.config)
    result = evaluate(
        args.model,
        prepared,
        args.out,
        base=args.base,
        speakers=args.speaker or None,
        texts=texts or None,
        max_texts=args.max_texts,
        num_samples=args.num_samples,
        seed=args.seed,
        limit_factor=args.limit_factor,
        icl=not args.no_icl,
        alpha=args.alpha,
        asr=args.asr,
        device=args.device,
        dtype=args.dtype,
        trust_checkpoint=args.trust_checkpoint,
        held_out=args.held_out,
    )
    print(result["table"])
    print(*(args.out / name for name in ("evaluation.json", "evaluation.md", "evaluation.html", "audio")), sep="\n")
    return 0
