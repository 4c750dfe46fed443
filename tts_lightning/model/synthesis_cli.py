"""`tts-lightning synthesize`: speak texts with a model directory (`tts_lightning.model.synthesis`).

tts-lightning synthesize --model runs/voice --speaker alice --text "Hello." --out hello.wav
tts-lightning synthesize --model BASE_DIR --ref-audio clip.wav --text-file texts.txt --out wavs/
tts-lightning synthesize --model ICL_VOICE --ref-audio clip.wav --ref-text "What clip.wav says." --text Hi. --out hi.wav

The model and its speech tokenizer run on --device (default cuda when available, else cpu), in
--dtype (default bf16 on a GPU, fp32 on the CPU), --batch-size texts at a time.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# --out names that ask for audio this command does not write (it writes WAV).
OTHER_AUDIO = {".mp3", ".flac", ".ogg", ".opus", ".m4a", ".aac", ".aif", ".aiff"}


def synthesize_command(argv: list[str]) -> int:
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
    parser.add_argument(
        "--ref-text", help="transcript of --ref-audio: clone in ICL mode (reference codes and text in the prompt)"
    )
    parser.add_argument(
        "--streaming",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the streaming layout (text fed alongside the frames) or not; default: qwen_tts's "
        "(streaming for a base model, non-streaming for custom_voice); use the layout the model was trained on",
    )
    parser.add_argument("--language", default="Auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument(
        "--device",
        help="where the model and its speech tokenizer run: cpu, cuda or cuda:N (default: cuda when available)",
    )
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default bf16 on a GPU, fp32 on the CPU")
    parser.add_argument(
        "--batch-size",
        type=int,
        help="texts spoken at once (default 4; each holds its own cache and decoded audio on the device); "
        "the same --seed gives the same audio at the same --batch-size",
    )
    parser.add_argument("--out", type=Path, required=True, help="output .wav (one text) or folder (several texts)")
    args = parser.parse_args(argv)
    # After parsing: --help and usage errors without importing torch.
    from tts_lightning.model.synthesis import BATCH_SIZE, read_text_file, synthesize

    if any(not text.strip() for text in args.text):
        parser.error("--text is empty: give the words to speak")
    texts = list(args.text)
    if args.text_file:
        texts += read_text_file(args.text_file, "--text-file")
    if not texts:
        parser.error("give --text or --text-file" + (f" ({args.text_file} holds no text)" if args.text_file else ""))
    suffix = args.out.suffix.lower()
    if suffix in OTHER_AUDIO:
        parser.error(f"--out {args.out}: synthesize writes WAV; give a .wav file (one text) or a folder")
    if suffix == ".wav" and len(texts) > 1:
        parser.error(f"--out {args.out} is one file for {len(texts)} texts; give a folder (one .wav per text)")

    from tts_lightning.files import atomic_write_wav

    wavs, sr = synthesize(
        args.model,
        texts,
        speaker=args.speaker,
        ref_audio=args.ref_audio,
        ref_text=args.ref_text,
        streaming=args.streaming,
        language=args.language,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        dtype=args.dtype,
        batch_size=BATCH_SIZE if args.batch_size is None else args.batch_size,
    )
    if suffix == ".wav":
        outs = [args.out]
    else:
        outs = [args.out / f"{i:03d}.wav" for i in range(len(wavs))]
    for wav, out in zip(wavs, outs):
        atomic_write_wav(out, wav, sr)  # a full disk: one message, no partial file
        print(f"{out}  {len(wav) / sr:.2f} s")
    return 0
