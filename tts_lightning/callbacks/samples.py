"""`SpeakerSamplesCallback`: hear the run's voices while it trains.

After every N-th validation run it speaks a few fixed texts as each speaker of the run with the
current weights, logs the audio (24 kHz) and a mel spectrogram to TensorBoard at the global step,
a figure of each sample's spectrogram beside the speaker's real reference clip (time and frequency
axes, step and similarity in the title; the real clip's audio once as ``real/<speaker>``), and
logs ``val/speaker_similarity`` (resemblyzer cosine against the speakers' reference clips) so that
a `ModelCheckpoint` can monitor it, ``val/speaking_rate_ratio`` (seconds of speech per character
over the speaker's real clips'; 1 = the speaker's pace) and ``val/eos_failure_rate`` (the share of
samples that did not end within a limit set from the text's length and the speaker's pace). With
``asr`` (pocketsphinx or a Whisper checkpoint, the recognizers of `evaluate --asr`) it also logs
``val/cer`` and ``val/wer``, each sample transcribed and scored against its text.

Samples are generated in the layout the run trains (``data.layout``, ``data.streaming``), as
``generate_voice_clone`` builds it; an ``icl`` run clones each speaker from the reference clip and
transcript of its first training clip (`tts_lightning.data.references.speaker_references`). A run
from a custom_voice model puts each speaker's codec row in the slot, with a dialect speaker's dialect
as the language: the prompt ``generate_custom_voice(non_streaming_mode=not data.streaming)`` builds.

Once, when a run starts from step 0, the same samples are made with the untrained weights: the base
model cloning each speaker zero-shot from its x-vector (the speaker embedding the run trains with)
in the same layout. Their values are logged at step 0 as ``baseline/...`` (and
their audio as ``baseline_samples/...``): the line the fine-tuned voice has to beat. With
``stop_below_baseline=N`` training stops when the similarity stays below the baseline's for N
sampled validations in a row.

With ``held_out`` (`tts_lightning.callbacks.held_out`) every round also clones held-out speakers
zero-shot (ICL) and logs ``zero_shot_samples/...`` and ``val/zero_shot_similarity``; "before" is the
baseline round's (the untrained weights'), once at step 0: ``val/zero_shot_similarity_before``.

Every rank takes part in gathering the weights into a plain copy on rank 0 (`generation_copy`),
which generates and decodes with no collective inside; then every rank takes part in one broadcast
of rank 0's result and logs the same key, so the metric's epoch-end reduction is entered by all
ranks. Nothing collective depends on what rank 0 generated, so ranks cannot fall out of step.

Sampling is optional: when it fails (generation out of memory on a small card, a decoding error),
every rank learns of it through the broadcast and, by default (``on_error: skip``), warns once,
logs NaN for this round's metrics (a checkpoint monitor takes NaN as the worst value) and goes on
training and checkpointing; ``on_error: raise`` stops the run on every rank instead.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from tts_lightning.callbacks.figures import log_samples, tensorboard_loggers
from tts_lightning.callbacks.generation_copy import generation_model, on_device
from tts_lightning.callbacks.held_out import BEFORE as HELD_OUT_BEFORE
from tts_lightning.callbacks.held_out import HeldOutVoices
from tts_lightning.callbacks.intelligibility import SampleIntelligibility
from tts_lightning.callbacks.speaker_facts import SpeakerFacts
from tts_lightning.errors import ConfigError
from tts_lightning.metrics.speech import hit_frame_limit, max_new_tokens_for
from tts_lightning.model.custom_voice import spoken_languages
from tts_lightning.model.generation import SAMPLE_RATE, decode_codes, generate_codes, rng_devices
from tts_lightning.names import some_names, unknown_names

DEFAULT_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Please call me back when you get this message.",
)
METRIC_NAME = "val/speaker_similarity"
RATE_NAME = "val/speaking_rate_ratio"
EOS_NAME = "val/eos_failure_rate"
METRICS = {
    "speaker_similarity": METRIC_NAME,
    "speaking_rate_ratio": RATE_NAME,
    "eos_failure_rate": EOS_NAME,
    "cer": "val/cer",  # with asr only
    "wer": "val/wer",
    "zero_shot_similarity": "val/zero_shot_similarity",  # with held_out only
}
BASELINE_PREFIX = "baseline/"
FAILED: dict[str, float | None] = {}  # what a failed sampling round returns (compared by identity)


MAX_SAMPLED_SPEAKERS = 8  # the default: a round of 100 speakers x 2 texts took minutes on CPU


class SpeakerSamplesCallback(Callback):
    """Audio samples, spectrograms and speaker similarity of the run's voices during training.

    Args:
        every_n_val_epochs: run after every N-th validation run (the sanity check does not count).
        texts: what each speaker says.
        max_new_tokens: cap on generated frames per sample (12.5 frames per second).
        seed: sampling seed, so samples differ only by the weights. Training's RNG is never touched.
        similarity: score the samples against the speakers' reference clips with resemblyzer and
            log ``val/speaker_similarity`` (off, with one warning, when resemblyzer is missing).
        language: the language tag to speak with; default each speaker's most common training
            language from the data module's prepared index, else "auto".
        speakers: the speakers to sample; default all of the run's speakers, up to ``max_speakers``.
        max_speakers: without ``speakers``, a run of more speakers samples this many, evenly spaced
            in the run's order of them (sorted, unless ``data.speakers`` orders them; said once):
            every round generates, decodes, draws and logs each speaker x text (None: all of them).
        baseline: when the run starts at step 0, sample once with the untrained weights (zero-shot
            x-vector cloning) and log ``baseline/speaker_similarity``, ``baseline/speaking_rate_ratio``
            and ``baseline/eos_failure_rate`` at step 0.
        stop_below_baseline: stop training when ``val/speaker_similarity`` is below the baseline's for
            this many sampled validations in a row (None: never).
        limit_factor: a sample fails to end when it runs past this many times the speaker's time for
            its text (``max_new_tokens`` still caps it).
        on_error: ``skip`` (warn, log NaN, keep training) or ``raise`` (stop the run) when sampling
            or scoring fails.
        asr: None (default), "pocketsphinx" or a Whisper checkpoint (hub name or folder): transcribe
            the samples and log ``val/cer`` and ``val/wer`` (as ``evaluate --asr`` scores them).
        held_out: None (default) or a manifest of held-out speakers (as ``evaluate --held-out``): clone
            them zero-shot (ICL) every round and log ``val/zero_shot_similarity`` (the untrained weights'
            once as ``val/zero_shot_similarity_before``). Refused (ConfigError) from a CustomVoice model.
    """

    def __init__(
        self,
        every_n_val_epochs: int = 1,
        texts: list[str] = list(DEFAULT_TEXTS),
        max_new_tokens: int = 240,
        seed: int = 0,
        similarity: bool = True,
        language: str | None = None,
        speakers: list[str] | None = None,
        max_speakers: int | None = MAX_SAMPLED_SPEAKERS,
        baseline: bool = True,
        stop_below_baseline: int | None = None,
        limit_factor: float = 3.0,
        on_error: Literal["skip", "raise"] = "skip",
        asr: str | None = None,
        held_out: str | None = None,
    ) -> None:
        if every_n_val_epochs < 1:
            raise ValueError(f"every_n_val_epochs must be >= 1, got {every_n_val_epochs}")
        texts = [t for t in texts if t and t.strip()]
        if not texts:
            raise ValueError("texts must hold at least one non-empty text")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.every_n_val_epochs = int(every_n_val_epochs)
        self.texts = list(texts)
        self.max_new_tokens = int(max_new_tokens)
        self.seed = seed
        self.similarity = similarity
        self.language = language
        self.speakers = None if speakers is None else list(speakers)
        if max_speakers is not None and max_speakers < 1:
            raise ValueError(f"max_speakers must be >= 1 or None, got {max_speakers}")
        self.max_speakers = max_speakers
        if stop_below_baseline is not None and stop_below_baseline < 1:
            raise ValueError(f"stop_below_baseline must be >= 1 or None, got {stop_below_baseline}")
        if limit_factor <= 0:
            raise ValueError(f"limit_factor must be > 0, got {limit_factor}")
        if on_error not in ("skip", "raise"):
            raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
        self.on_error = on_error
        self.asr = asr
        self.intelligibility = None if asr is None else SampleIntelligibility(asr)
        self.held_out = None if held_out is None else HeldOutVoices(held_out)
        self.baseline = baseline
        self.stop_below_baseline = stop_below_baseline
        self.limit_factor = float(limit_factor)
        self.baseline_values: dict[str, float | None] | None = None
        self.below_baseline = 0
        self.validation_runs = 0
        self._warned: set[str] = set()
        self._real_logged: set[str] = set()  # speakers whose real clip TensorBoard has
        self._text = None  # text tokenizer, rank 0 only
        self._speech = None  # speech tokenizer, rank 0 only, kept in host memory
        self.facts = SpeakerFacts(
            language=language,
            speakers=self.speakers,
            max_speakers=self.max_speakers,
            max_new_tokens=self.max_new_tokens,
            limit_factor=self.limit_factor,
            warn=self._warn_once,
        )

    # -- state ---------------------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_val_epochs=self.every_n_val_epochs, texts=self.texts)

    def state_dict(self) -> dict[str, Any]:
        return {
            "validation_runs": self.validation_runs,
            "baseline_values": self.baseline_values,
            "below_baseline": self.below_baseline,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.validation_runs = int(state_dict.get("validation_runs", 0))
        if state_dict.get("baseline_values") is not None:
            self.baseline_values = state_dict["baseline_values"]
        self.below_baseline = int(state_dict.get("below_baseline", 0))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    # -- the hooks ------------------------------------------------------------------------------
    def check_speakers(self, names: Sequence[str]) -> None:
        """Refuse ``speakers`` the run does not have (``names``): a typo would sample nobody, said
        by a warning mid-run. `tts-lightning` checks it before the ranks start; `setup` on each."""
        unknown = sorted(set(self.speakers or ()) - set(names))
        if unknown:
            raise ConfigError(
                f"SpeakerSamplesCallback: speakers {unknown_names(unknown, names)} are not in this run "
                f"({some_names(names)})"
            )

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse, before training, speakers the run does not have and a checkpoint monitor this
        callback cannot feed: without the similarity scorer ``val/speaker_similarity`` is never
        logged, and `ModelCheckpoint` would fail after the first validation. Decided the same way
        on every rank."""
        self.check_speakers(list(getattr(pl_module, "speakers", []) or []))
        if self.held_out is not None:  # a CustomVoice start, a bad manifest: refused here, on every rank
            self.held_out.check(pl_module)
        if stage != "fit":
            return
        if self.intelligibility is not None:
            self.intelligibility.check_installed()
        monitors = {getattr(cb, "monitor", None) for cb in trainer.checkpoint_callbacks}
        if METRIC_NAME not in monitors:
            return
        reason: str | None = "SpeakerSamplesCallback has similarity: false"
        if self.similarity:
            from tts_lightning.metrics.speaker_similarity import similarity_unavailable

            reason = similarity_unavailable()
        if reason is not None:
            raise ValueError(
                f"checkpoint.monitor is {METRIC_NAME}, which this run cannot log: {reason}; "
                "or monitor the loss (checkpoint.monitor: val/loss, checkpoint.mode: min)"
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The zero-shot baseline, once, with the base weights: a run from step 0 samples here, before
        its first step. A resumed run keeps the one its checkpoint saved and samples nothing: by this
        hook every strategy has restored the checkpoint (``trainer.ckpt_path`` is set). Under FSDP,
        which restores after ``on_fit_start``, a baseline there ran again at every resume (the
        path is only set when the restore starts)."""
        resumed = trainer.ckpt_path is not None or trainer.global_step > 0
        if not (self.baseline or self.held_out) or self.baseline_values is not None or resumed:
            return
        loggers = tensorboard_loggers(trainer, self._warn_once)
        scoring = self.similarity and self._similarity_available()
        if not loggers and not scoring and self.intelligibility is None:
            return
        values = self._sample_collectively(trainer, pl_module, loggers, scoring, baseline=True)
        if values is not FAILED:
            self.baseline_values = values

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # `self.log` is allowed here (not in on_validation_end), so the similarity can be monitored.
        if trainer.sanity_checking:
            return
        self.validation_runs += 1
        if self.validation_runs % self.every_n_val_epochs:
            return
        # Decided identically on every rank (same loggers, same environment): no collective is
        # skipped by one rank and entered by another.
        loggers = tensorboard_loggers(trainer, self._warn_once)
        scoring = self.similarity and self._similarity_available()
        if not loggers and not scoring and self.intelligibility is None:
            return
        values = self._sample_collectively(trainer, pl_module, loggers, scoring, baseline=False)
        if values is None:
            return
        if values is FAILED:  # NaN: the checkpoint monitor's worst, not a missing key that would stop the run
            values = {key: float("nan") for key in self._metric_keys(scoring)}
        for key, name in METRICS.items():
            value = values.get(key)
            if value is not None:
                # The same value and key on every rank; the epoch-end reduction is entered by all.
                pl_module.log(name, float(value), on_step=False, on_epoch=True, sync_dist=True, batch_size=1)
        self._check_baseline(trainer, values)

    def _metric_keys(self, scoring: bool) -> list[str]:
        """The metrics a sampling round logs: similarity when scored, CER / WER with asr."""
        skip = set() if scoring else {"speaker_similarity", "zero_shot_similarity"}
        skip |= set() if self.held_out else {"zero_shot_similarity"}
        return [k for k in METRICS if k not in skip and (k not in ("cer", "wer") or self.intelligibility)]

    def _check_baseline(self, trainer: pl.Trainer, values: dict[str, float | None]) -> None:
        """Early stop on similarity below the baseline; every rank holds the same broadcast values,
        so every rank decides the same."""
        if self.stop_below_baseline is None:
            return
        base = (self.baseline_values or {}).get("speaker_similarity")
        ours = values.get("speaker_similarity")
        if base is None or ours is None:
            return
        self.below_baseline = self.below_baseline + 1 if ours < base else 0
        if self.below_baseline >= self.stop_below_baseline:
            rank_zero_warn(
                f"SpeakerSamplesCallback: {METRIC_NAME} has been below the zero-shot baseline ({base:.4f}) for "
                f"{self.below_baseline} sampled validation(s) in a row (now {ours:.4f}); stopping training"
            )
            trainer.should_stop = True

    def _sample_collectively(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loggers: list, scoring: bool, *, baseline: bool
    ) -> dict[str, float | None] | None:
        """Collective on all ranks: rank 0 generates, logs and scores; every rank returns rank 0's
        metric values (None when nothing was sampled, `FAILED` when it failed anywhere)."""
        values: dict[str, float | None] | None = None
        error: BaseException | None = None
        generated = None
        # Sampling, and building the tokenizers and the encoder (random init before loading), draw
        # from the global RNG: training's stream must not see it.
        try:  # building rank 0's copy can fail too (out of memory): it must reach the broadcast as well
            generated = self._generate_on_copy(trainer, pl_module, baseline)
        except Exception as exc:  # raised on every rank below, after the broadcast
            _drop_frame_locals(exc)  # the failed frames' locals would keep the copy alive
            if pl_module.device.type == "cuda":
                torch.cuda.empty_cache()  # the copy's blocks, freed only now
            error = exc
        if generated is not None:  # rank 0, the generation copy freed
            try:
                with torch.random.fork_rng(devices=rng_devices(pl_module.device)):
                    values = self._log_and_score(trainer, pl_module, generated, loggers, scoring, baseline=baseline)
            except Exception as exc:
                error = exc
        shared = trainer.strategy.broadcast(
            {"values": values, "error": None if error is None else f"{type(error).__name__}: {error}"},
            src=0,
        )
        failure = shared["error"] or (None if error is None else f"{type(error).__name__}: {error}")
        if failure is None:
            return cast("dict[str, float | None] | None", shared["values"])  # rank 0's, broadcast
        if self.on_error == "raise":
            if error is not None:
                raise error
            raise RuntimeError(f"SpeakerSamplesCallback failed on rank 0: {failure}")
        what = "the zero-shot baseline" if baseline else f"samples at step {trainer.global_step}"
        self._warn_once(
            f"failed: {failure}",
            f"SpeakerSamplesCallback: {what} failed ({failure}); skipped, training goes on "
            "(on_error: raise makes this stop the run)",
        )
        return FAILED

    def _generate_on_copy(self, trainer: pl.Trainer, pl_module: pl.LightningModule, baseline: bool):
        """Collective on all ranks (the copy is gathered): `_generate` on rank 0's generation copy,
        None elsewhere. The copy is freed on return, before anything is decoded or scored."""
        with generation_model(trainer, pl_module) as model:
            if model is None:
                return None
            try:
                with torch.random.fork_rng(devices=rng_devices(pl_module.device)):
                    return self._generate(trainer, pl_module, model, baseline)
            finally:
                del model  # the context's reference is then the last one: it frees the copy on exit

    # -- rank 0 ---------------------------------------------------------------------------------
    def _generate(self, trainer: pl.Trainer, pl_module: pl.LightningModule, model: nn.Module, baseline: bool):
        """(the run's speakers' samples, the held-out clones), each None when not made; None for neither.
        A baseline round without ``baseline`` makes the held-out clones alone."""
        modes = {m: m.training for m in model.modules()}
        model.eval()
        try:
            with torch.no_grad():
                own = self._generate_own(trainer, pl_module, model) if self.baseline or not baseline else None
                held = None
                if self.held_out is not None:
                    tokenizers = (self._text_tokenizer(pl_module), self._speech_tokenizer(pl_module))
                    options = {"seed": self.seed, "max_new_tokens": self.max_new_tokens}
                    held = self.held_out.generate(pl_module, model, tokenizers, self.texts, **options)
        finally:
            for module, training in modes.items():
                module.training = training
        return None if own is None and held is None else (own, held)

    def _generate_own(self, trainer: pl.Trainer, pl_module: pl.LightningModule, model: nn.Module) -> tuple | None:
        """(rows, codes, ...) for every (speaker, text), or None when no speaker has an embedding yet."""
        speakers, embeddings = self.facts.speaker_rows(trainer, pl_module)
        if not speakers:
            return None
        codec_ids = getattr(pl_module, "speaker_codec_ids", None)
        if codec_ids is not None:  # a custom_voice run: each speaker is its row of the model that speaks
            weight = cast(Any, model).talker.get_input_embeddings().weight
            names = list(cast(Any, pl_module).speakers)
            embeddings = weight[[codec_ids[names.index(s)] for s in speakers]].detach().float()
        text_tokenizer = self._text_tokenizer(pl_module)
        from tts_lightning.data.references import generation_prompts
        from tts_lightning.model.sequence import tokenize_text

        rows = [(s, i) for s in speakers for i in range(len(self.texts))]
        # The layout the run trains, an icl run cloning from each speaker's training reference.
        layout, prompts = generation_prompts(getattr(trainer, "datamodule", None), speakers, text_tokenizer)
        references = [prompts[s] for s, _ in rows] if prompts else None
        text_ids = [tokenize_text(text_tokenizer, self.texts[i]) for _, i in rows]
        languages = [self.facts.language_of(trainer, s) for s, _ in rows]
        if codec_ids is not None:  # a dialect speaker's dialect, as generate_custom_voice tags it
            languages = spoken_languages(cast(Any, model).config.talker_config, [s for s, _ in rows], languages)
        row_embeddings = torch.stack([embeddings[speakers.index(s)] for s, _ in rows])
        limits = [self.facts.frame_limit(trainer, s, self.texts[i]) for s, i in rows]
        codes = generate_codes(
            model,
            text_ids,
            row_embeddings,
            languages,
            max_new_tokens=max_new_tokens_for(max(limits)),
            seed=self.seed,
            dtype=cast(Any, model.talker).get_input_embeddings().weight.dtype,
            layout=layout,
            references=references,
        )
        failures = [hit_frame_limit(c.shape[0], limit) for c, limit in zip(codes, limits)]
        prefixes = [c for _, c in references] if references else None  # decoded before the samples
        return rows, [c[:limit] for c, limit in zip(codes, limits)], failures, prefixes

    def _log_and_score(self, trainer, pl_module, generated: tuple, loggers: list, scoring: bool, *, baseline=False):
        own, held = generated
        values = {} if own is None else self._log_and_score_own(trainer, pl_module, own, loggers, scoring, baseline)
        if held is not None and self.held_out is not None:
            shown = {"texts": self.texts, "scoring": scoring, "before": baseline, "real_logged": self._real_logged}
            speech, step = self._speech_tokenizer(pl_module), int(trainer.global_step)
            values["zero_shot_similarity"] = self.held_out.log_and_score(
                held, speech, pl_module.device, loggers, step, **shown
            )
        if baseline:
            for logger in loggers:
                for key, value in values.items():
                    if value is not None:
                        name = HELD_OUT_BEFORE if key == "zero_shot_similarity" else BASELINE_PREFIX + key
                        logger.experiment.add_scalar(name, value, int(trainer.global_step))
                logger.experiment.flush()
        return values

    def _log_and_score_own(self, trainer, pl_module, generated: tuple, loggers: list, scoring: bool, baseline: bool):
        rows, codes, failures, prefixes = generated
        speech_tokenizer = self._speech_tokenizer(pl_module)
        with on_device(speech_tokenizer, pl_module.device):
            wavs = decode_codes(speech_tokenizer, codes, prefixes)
        step = int(trainer.global_step)
        names = ("baseline_samples", "baseline_spectrograms") if baseline else ("samples", "spectrograms")
        similarity, scores = self.facts.similarity(trainer, rows, wavs) if scoring else (None, {})
        for logger in loggers:
            for speaker, score in scores.items():
                name = f"{BASELINE_PREFIX}speaker_similarity" if baseline else METRIC_NAME
                logger.experiment.add_scalar(f"{name}/{speaker}", score, step)
        real = {s: self.facts.reference_clip(trainer, s) for s in dict.fromkeys(s for s, _ in rows)}
        values: dict[str, float | None] = {
            "speaker_similarity": similarity,
            "speaking_rate_ratio": self.facts.rate_ratio(trainer, rows, wavs, self.texts),
            "eos_failure_rate": sum(failures) / len(failures),
        }
        transcripts = None
        if self.intelligibility is not None:
            texts = [self.texts[i] for _, i in rows]
            rates, transcripts = self.intelligibility.score(texts, wavs, SAMPLE_RATE, str(pl_module.device))
            values.update(rates)
        new_real = {s for s, c in real.items() if c is not None and s not in self._real_logged}
        logged = (names, self.texts, rows, wavs, step, real, scores, new_real, transcripts)
        for logger in loggers:
            log_samples(logger.experiment, *logged)
        self._real_logged.update(new_real)
        return values

    # -- helpers -----------------------------------------------------------------------------------
    def _similarity_available(self) -> bool:
        from tts_lightning.metrics.speaker_similarity import similarity_unavailable

        reason = similarity_unavailable()
        if reason is not None:
            self._warn_once("similarity", f"SpeakerSamplesCallback: {METRIC_NAME} is off: {reason}")
            return False
        return True

    def _text_tokenizer(self, pl_module: pl.LightningModule):
        if self._text is None:
            from tts_lightning.model.pretrained import check_pretrained, load_text_tokenizer

            self._text = load_text_tokenizer(check_pretrained(pl_module.hparams["pretrained"]))
        return self._text

    def _speech_tokenizer(self, pl_module: pl.LightningModule):
        """Loaded once, in host memory (`on_device` moves it to the GPU to decode)."""
        if self._speech is None:
            from tts_lightning.model.pretrained import check_pretrained, load_speech_tokenizer

            self._speech = load_speech_tokenizer(check_pretrained(pl_module.hparams["pretrained"]), device="cpu")
        return self._speech


def _drop_frame_locals(error: BaseException) -> None:
    """Clear the local variables of the finished frames in ``error``'s traceback and in those of the
    exceptions it was raised from or during (its lines stay, to be shown or raised again)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__
