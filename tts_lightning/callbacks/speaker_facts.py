"""What sampling needs to know of the run's speakers, read once from the data module's prepared index:
which speakers to sample and their embeddings, the language each speaks, reference embeddings to
score against, and each speaker's pace (seconds of speech per character on its real clips), which
sets how long a sample may run before it counts as not ending."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor

from tts_lightning.model.generation import SAMPLE_RATE

PACE_CLIPS = 8  # at most this many of a speaker's clips measure its pace


def spread(names: list[str], count: int) -> list[str]:
    """``count`` of ``names``, evenly spaced: the same ones every round and run."""
    return [names[i * len(names) // count] for i in range(count)]


class SpeakerFacts:
    """Per-speaker facts for `SpeakerSamplesCallback`, cached after the first read.

    Args: ``language`` (None: each speaker's most common training language), ``speakers`` (None:
    all of the run's), ``max_new_tokens`` and ``limit_factor`` (the frame limit of a sample), and
    ``warn(key, message)``, which warns once per key."""

    def __init__(
        self,
        *,
        language: str | None,
        speakers: list[str] | None,
        max_speakers: int | None = None,
        max_new_tokens: int,
        limit_factor: float,
        warn: Callable[[str, str], None],
    ) -> None:
        self.language = language
        self.speakers = speakers
        self.max_speakers = max_speakers
        self.max_new_tokens = max_new_tokens
        self.limit_factor = limit_factor
        self.warn = warn
        self._index: dict | None = None
        self._references: dict[str, Tensor] = {}
        self._paces: dict[str, float | None] = {}
        self._clips: dict[str, np.ndarray | None] = {}

    def prepared_index(self, trainer: pl.Trainer) -> dict | None:
        """The data module's ``prepared.json`` (speakers, their reference clips, clip languages)."""
        if self._index is None:
            read_index = getattr(getattr(trainer, "datamodule", None), "read_index", None)
            if read_index is None:
                return None
            try:
                self._index = read_index()
            except (OSError, RuntimeError, ValueError) as exc:
                self.warn("index", f"SpeakerSamplesCallback cannot read the prepared index: {exc}")
                return None
        return self._index

    def speaker_rows(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[list[str], Tensor]:
        """The speakers to sample and their fp32 embeddings: the model's buffer (what the run trains
        and exports with), rows not filled there yet taken from the data module's table."""
        names = list(getattr(pl_module, "speakers", []) or [])
        table = cast(Tensor, pl_module.speaker_embeddings).detach().float().cpu().clone()
        datamodule = getattr(trainer, "datamodule", None)
        missing = [i for i in range(len(names)) if not bool(table[i].abs().sum() > 0)]
        if missing and datamodule is not None and list(getattr(datamodule, "speaker_names", [])) == names:
            try:
                source = datamodule.speaker_embeddings().float().cpu()
                for i in missing:
                    table[i] = source[i]
            except RuntimeError:
                pass
        wanted = names if self.speakers is None else [s for s in self.speakers if s in names]
        if self.speakers is None and self.max_speakers is not None and len(names) > self.max_speakers:
            wanted = spread(names, self.max_speakers)
            self.warn(
                "many",
                f"SpeakerSamplesCallback: samples {len(wanted)} of the run's {len(names)} speakers "
                f"({', '.join(wanted)}): name others with `speakers`, or raise `max_speakers`",
            )
        # A custom_voice run's speakers are codec rows, all there from the start (the sampler reads them).
        rows = getattr(pl_module, "speaker_codec_ids", None) is not None
        keep = [s for s in wanted if rows or bool(table[names.index(s)].abs().sum() > 0)]
        if len(keep) != len(wanted):
            self.warn(
                "empty", f"SpeakerSamplesCallback: no embedding yet for {sorted(set(wanted) - set(keep))}; not sampled"
            )
        return keep, torch.stack([table[names.index(s)] for s in keep]) if keep else table[:0]

    def language_of(self, trainer: pl.Trainer, speaker: str) -> str:
        if self.language:
            return self.language
        index = self.prepared_index(trainer)
        if index is None:
            return "auto"
        from tts_lightning.data.predict import speaker_languages

        return speaker_languages(index).get(speaker, "auto")

    def reference_embedding(self, trainer: pl.Trainer, speaker: str) -> Tensor | None:
        if speaker not in self._references:
            index = self.prepared_index(trainer)
            entry = next((s for s in (index or {}).get("speakers", []) if s.get("name") == speaker), None)
            if not entry or not entry.get("references"):
                self.warn(
                    f"refs-{speaker}",
                    f"SpeakerSamplesCallback: no reference clips for {speaker!r} "
                    "(trainer.datamodule.read_index() gives none); not scored",
                )
                return None
            from tts_lightning.data.audio import load_audio
            from tts_lightning.metrics.speaker_similarity import reference_embedding

            clips = [load_audio(path, SAMPLE_RATE) for path in entry["references"]]
            self._references[speaker] = reference_embedding(clips, SAMPLE_RATE)
        return self._references[speaker]

    def similarity(self, trainer: pl.Trainer, rows: list, wavs: list) -> tuple[float | None, dict[str, float]]:
        """The mean similarity of the audible samples (``rows``: (speaker, text index)) to their
        speakers' reference clips (None when none could be scored), and per speaker."""
        from tts_lightning.metrics.speaker_similarity import SpeakerSimilarity

        # Rank 0 alone scores: its metrics must not sync in compute() (a collective the other
        # ranks never enter). The result reaches them through the broadcast.
        overall = SpeakerSimilarity(sample_rate=SAMPLE_RATE, sync_on_compute=False)
        scores: dict[str, float] = {}
        for speaker in dict.fromkeys(s for s, _ in rows):
            generated = [w for (s, _), w in zip(rows, wavs) if s == speaker and w.size and np.abs(w).max() > 0]
            reference = self.reference_embedding(trainer, speaker)
            if reference is None or not generated:
                continue
            one = SpeakerSimilarity(sample_rate=SAMPLE_RATE, sync_on_compute=False)
            one.update(generated, reference)
            overall.update(generated, reference)
            scores[speaker] = float(one.compute())
        if int(overall.count) == 0:
            self.warn(
                "no-score",
                "SpeakerSamplesCallback: no sample could be scored (no reference clips "
                "or only empty audio); val/speaker_similarity is not logged",
            )
            return None, scores
        return float(overall.compute()), scores

    def reference_clip(self, trainer: pl.Trainer, speaker: str) -> np.ndarray | None:
        """The speaker's first reference clip at 24 kHz (what its samples are shown beside), None
        when the prepared index has none or it cannot be read."""
        if speaker not in self._clips:
            index = self.prepared_index(trainer) or {}
            entry = next((s for s in index.get("speakers", []) if s.get("name") == speaker), None) or {}
            clip = None
            if entry.get("references"):
                from tts_lightning.data.audio import load_audio

                try:
                    clip = load_audio(entry["references"][0], SAMPLE_RATE).numpy().reshape(-1)
                except (OSError, ValueError, RuntimeError) as exc:
                    self.warn(f"clip-{speaker}", f"SpeakerSamplesCallback: cannot read {speaker!r}'s reference ({exc})")
            self._clips[speaker] = clip
        return self._clips[speaker]

    def pace(self, trainer: pl.Trainer, speaker: str) -> float | None:
        """The speaker's seconds of speech per character on its real clips (its reference and
        validation clips, else its first clips; at most `PACE_CLIPS`), None without a prepared index."""
        if speaker not in self._paces:
            index = self.prepared_index(trainer) or {}
            entry = next((s for s in index.get("speakers", []) if s.get("name") == speaker), None) or {}
            refs = set(entry.get("references") or [])
            own = [c for c in index.get("clips", []) if c.get("speaker") == speaker and c.get("text")]
            chosen = ([c for c in own if c["audio"] in refs or c.get("split") == "val"] or own)[:PACE_CLIPS]
            pace = None
            if chosen:
                from tts_lightning.data.audio import load_audio
                from tts_lightning.metrics.speech import seconds_per_character

                try:
                    pace = (
                        seconds_per_character(
                            [load_audio(c["audio"], SAMPLE_RATE).numpy() for c in chosen],
                            [c["text"] for c in chosen],
                            SAMPLE_RATE,
                        )
                        or None
                    )
                except (OSError, ValueError, RuntimeError) as exc:
                    self.warn(
                        f"pace-{speaker}",
                        f"SpeakerSamplesCallback: cannot measure {speaker!r}'s pace "
                        f"({exc}); its samples are capped by max_new_tokens only",
                    )
            self._paces[speaker] = pace
        return self._paces[speaker]

    def rate_ratio(self, trainer: pl.Trainer, rows: list, wavs: list, texts: list[str]) -> float | None:
        """Mean over audible samples (``rows``: (speaker, text index)) of their seconds per character
        over their speaker's."""
        from tts_lightning.metrics.speech import speaking_rate_ratio

        ratios = []
        for (speaker, i), wav in zip(rows, wavs):
            pace = self.pace(trainer, speaker)
            if pace is None or wav.size == 0 or not np.abs(wav).max() > 0:
                continue
            ratios.append(speaking_rate_ratio(wav, texts[i], SAMPLE_RATE, pace))
        return float(np.mean(ratios)) if ratios else None

    def frame_limit(self, trainer: pl.Trainer, speaker: str, text: str) -> int:
        """Frames a sample may take before it counts as not ending: from the text and the speaker's
        pace, at most ``max_new_tokens``."""
        from tts_lightning.metrics.speech import frame_limit

        pace = self.pace(trainer, speaker)
        if pace is None:
            return self.max_new_tokens
        return frame_limit(text, pace, factor=self.limit_factor, max_frames=self.max_new_tokens)
