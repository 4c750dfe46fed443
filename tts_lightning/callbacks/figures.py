"""TensorBoard figures of sampled speech: per speaker and text, the generated clip's mel spectrogram
beside the speaker's real reference clip, with time (s) and frequency (Hz) axes, the step and the
speaker similarity in the title; `log_samples` writes them with the audio, the spectrogram images,
the texts and (with asr) what the recognizer heard."""

from __future__ import annotations

import numpy as np
import torch

from tts_lightning.callbacks.spectrogram import HOP, mel_db, mel_image
from tts_lightning.model.generation import SAMPLE_RATE


def comparison_figure(generated: np.ndarray, real: np.ndarray | None, title: str, sample_rate: int = SAMPLE_RATE):
    """A matplotlib figure (Agg canvas, no pyplot state): generated left, real right (when given)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [("generated", generated)] + ([("real reference", real)] if real is not None else [])
    fig = Figure(figsize=(5.0 * len(panels), 3.2), dpi=80)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, audio) in zip(axes, panels):
        db, freqs = mel_db(audio, sample_rate)
        seconds = db.shape[1] * HOP / sample_rate
        # Mel bands are not evenly spaced in Hz: pcolormesh puts each at its own frequency.
        times = np.arange(db.shape[1] + 1) * HOP / sample_rate
        edges = np.concatenate([[0.0], (freqs[1:] + freqs[:-1]) / 2, [sample_rate / 2]])
        mesh = ax.pcolormesh(times, edges, db, cmap="magma", shading="flat")
        ax.set_xlim(0.0, seconds)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("frequency (Hz)")
        ax.set_title(name, fontsize=9)
        fig.colorbar(mesh, ax=ax, label="dB")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def log_comparisons(
    writer, prefix: str, rows: list, wavs: list, texts: list[str], real: dict, scores: dict, step: int
) -> None:
    """One figure per (speaker, text index) row under ``{prefix}/{speaker}/{i}``."""
    for (speaker, i), wav in zip(rows, wavs):
        if wav.size == 0:
            continue
        score = scores.get(speaker)
        similarity = "n/a" if score is None else f"{score:.3f}"
        title = f"{speaker}, step {step}, similarity {similarity}: {texts[i][:60]}"
        writer.add_figure(f"{prefix}/{speaker}/{i}", comparison_figure(wav, real.get(speaker), title), step)


def log_samples(
    writer,
    names: tuple[str, str],
    texts: list[str],
    rows: list,
    wavs: list,
    step: int,
    real: dict,
    scores: dict,
    new_real: set[str],
    transcripts: list[str] | None = None,
) -> None:
    """One sampling round to TensorBoard: the texts, per (speaker, text index) row the audio, its
    spectrogram image and its figure beside the real clip (``names``: the audio's and the images'
    tag prefixes), the real clips of ``new_real`` (once per run) and the transcripts."""
    samples, spectrograms = names
    for i, text in enumerate(texts):
        writer.add_text(f"{samples}/text_{i}", text, step)
    for (speaker, i), wav in zip(rows, wavs):
        if wav.size == 0:
            continue
        audio = torch.from_numpy(np.clip(wav, -1.0, 1.0))[None]
        writer.add_audio(f"{samples}/{speaker}/{i}", audio, step, sample_rate=SAMPLE_RATE)
        writer.add_image(f"{spectrograms}/{speaker}/{i}", mel_image(wav), step, dataformats="CHW")
    log_comparisons(writer, f"{spectrograms}_vs_real", rows, wavs, texts, real, scores, step)
    for speaker in sorted(new_real):  # the real voice to listen to, beside the samples
        writer.add_audio(f"real/{speaker}", torch.from_numpy(real[speaker])[None], step, sample_rate=SAMPLE_RATE)
    for (speaker, i), heard in zip(rows, transcripts or []):  # what the recognizer heard
        writer.add_text(f"{samples}/{speaker}/{i}/transcript", heard or "(nothing)", step)
    writer.flush()


def tensorboard_loggers(trainer, warn) -> list:
    """The trainer's TensorBoard loggers (the only ones that take audio); ``warn(key, message)`` says
    once when there is none."""
    from lightning.pytorch.loggers import TensorBoardLogger

    found = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
    if not found:
        names = ", ".join(type(lg).__name__ for lg in trainer.loggers) or "none"
        warn(
            "logger",
            f"SpeakerSamplesCallback logs audio and spectrograms to TensorBoard only; "
            f"the trainer has no TensorBoardLogger (loggers: {names}), so none are logged",
        )
    return found
