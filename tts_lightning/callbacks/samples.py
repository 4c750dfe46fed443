"""`SpeakerSamplesCallback`: hear the run's voices while it trains.

After every N-th validation run it speaks a few fixed texts as each speaker of the run with the
current weights, logs the audio (24 kHz) and a mel spectrogram to TensorBoard at the global step,
and logs ``val/speaker_similarity`` (resemblyzer cosine against the speakers' reference clips) so
that a `ModelCheckpoint` can monitor it, ``val/speaking_rate_ratio`` (seconds of speech per character
over the speaker's real clips'; 1 = the speaker's pace) and ``val/eos_failure_rate`` (the share of
samples that did not end within a limit set from the text's length and the speaker's pace).

Once, when a run starts from step 0, the same samples are made with the untrained weights: the base
model cloning each speaker zero-shot from its x-vector (the speaker embedding the run trains with,
non-streaming, the layout training uses). Their values are logged at step 0 as ``baseline/...`` (and
their audio as ``baseline_samples/...``): the line the fine-tuned voice has to beat. With
``stop_below_baseline=N`` training stops when the similarity stays below the baseline's for N
sampled validations in a row.

Under FSDP2 (`Qwen3TTSFSDP2Strategy`) every rank takes part in gathering the full state into rank
0's host memory one parameter at a time (``get_model_state_dict(full_state_dict=True,
cpu_offload=True)``), from which rank 0 builds the same plain copy. Under FSDP1 the weights are
flat shards outside the training step. Every rank enters
``FullyShardedDataParallel.summon_full_params(rank0_only=True, offload_to_cpu=True)`` (one
all-gather per unit, on all ranks, in the same order); rank 0 receives the full weights in host
memory, copies them into a plain model in the run's compute dtype on its device (bf16 under
bf16-mixed: 3.6 GiB for the 1.7B, never the 7.2 GiB fp32 model) and generates with it, with no
collective inside generation; the copy is freed before the speech tokenizer, kept in host memory,
visits the GPU to decode. Then every rank takes part in one broadcast of rank 0's result and logs
the same key, so the metric's epoch-end reduction is entered by all ranks. Nothing collective
depends on what rank 0 generated, so ranks cannot fall out of step; if generation fails on rank 0
the failure is broadcast and every rank raises instead of waiting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from tts_lightning.metrics.speech import hit_frame_limit, max_new_tokens_for
from tts_lightning.model.generation import SAMPLE_RATE, decode_codes, generate_codes

DEFAULT_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Please call me back when you get this message.",
)
METRIC_NAME = "val/speaker_similarity"
RATE_NAME = "val/speaking_rate_ratio"
EOS_NAME = "val/eos_failure_rate"
METRICS = {"speaker_similarity": METRIC_NAME, "speaking_rate_ratio": RATE_NAME, "eos_failure_rate": EOS_NAME}
BASELINE_PREFIX = "baseline/"
PACE_CLIPS = 8  # at most this many of a speaker's clips measure its pace


@contextlib.contextmanager
def generation_model(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Iterator[nn.Module | None]:
    """Collective on all ranks: a plain model to generate with on global rank 0, None elsewhere.

    Under FSDP (either strategy, any sharding, one rank or many) every rank takes part in gathering
    the full state into rank 0's *host* memory one unit (FSDP1) or parameter (FSDP2) at a time
    (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``); rank 0 copies it into a
    fresh model in the run's compute dtype (bf16 under bf16-mixed) on its device and the host copy
    is released before generation starts: the GPU holds the copy (2 bytes per parameter) only
    while sampling, never a second fp32 model. Generation then issues no collective at all.
    Without FSDP the module's own model is used, on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    from tts_lightning.model.generation import compute_dtype
    from tts_lightning.model.loading import copy_model

    plain = pl_module.model
    assert isinstance(plain, nn.Module)
    root = trainer.strategy.model
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if isinstance(root, FSDPModule):  # FSDP2: the parameters are DTensor shards
        policy = getattr(trainer.strategy, "mixed_precision_policy", None)
        dtype = getattr(policy, "param_dtype", None) or compute_dtype(plain)
        state = get_model_state_dict(plain, options=options)
    elif isinstance(root, FullyShardedDataParallel):
        # From the FSDP root (the LightningModule): its own unit holds parameters of the model too.
        # Keys are the LightningModule's ("model.talker..."); NO_SHARD (one rank) works the same.
        dtype = compute_dtype(plain)
        prefix = "model."
        state = {
            k[len(prefix) :]: v for k, v in get_model_state_dict(root, options=options).items() if k.startswith(prefix)
        }
    else:
        yield plain if trainer.is_global_zero else None
        return
    tensors = cast("dict[str, Tensor]", state)  # parameters and buffers only: all tensors
    model = copy_model(plain, dtype=dtype, device=pl_module.device, state=tensors) if trainer.is_global_zero else None
    del state, tensors
    try:
        yield model
    finally:
        del model
        if pl_module.device.type == "cuda":
            torch.cuda.empty_cache()


@contextlib.contextmanager
def speech_tokenizer_on(tokenizer, device: torch.device) -> Iterator[None]:
    """Keep the speech tokenizer in host memory except while it decodes on ``device``."""
    if device.type == "cpu":
        yield
        return
    tokenizer.model.to(device)
    tokenizer.device = device
    try:
        yield
    finally:
        tokenizer.model.to("cpu")
        tokenizer.device = torch.device("cpu")
        torch.cuda.empty_cache()


def mel_image(audio: np.ndarray, sample_rate: int = SAMPLE_RATE, n_mels: int = 80, top_db: float = 80.0) -> Tensor:
    """A log-mel spectrogram as a CHW float image in [0, 1], low frequencies at the bottom: RGB
    through matplotlib's magma colormap when matplotlib is installed, else one grey channel."""
    import torchaudio

    wave = torch.as_tensor(audio, dtype=torch.float32).reshape(-1)
    n_fft = 1024
    if wave.numel() < n_fft:
        wave = torch.nn.functional.pad(wave, (0, n_fft - wave.numel()))
    mel = torchaudio.transforms.MelSpectrogram(
        sample_rate=sample_rate, n_fft=n_fft, hop_length=256, n_mels=n_mels, f_max=sample_rate / 2
    )(wave)
    db = 10.0 * torch.log10(mel.clamp(min=1e-10))
    image = ((db - db.max() + top_db) / top_db).clamp(0.0, 1.0).flip(0)  # (n_mels, frames)
    try:
        from matplotlib import colormaps
    except ImportError:
        return image[None]
    rgb = colormaps["magma"](image.numpy())[..., :3]  # (H, W, 3)
    return torch.from_numpy(np.ascontiguousarray(rgb, dtype=np.float32)).permute(2, 0, 1)


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
        speakers: the speakers to sample; default all of the run's speakers.
        baseline: when the run starts at step 0, sample once with the untrained weights (zero-shot
            x-vector cloning) and log ``baseline/speaker_similarity``, ``baseline/speaking_rate_ratio``
            and ``baseline/eos_failure_rate`` at step 0.
        stop_below_baseline: stop training when ``val/speaker_similarity`` is below the baseline's for
            this many sampled validations in a row (None: never).
        limit_factor: a sample fails to end when it runs past this many times the speaker's time for
            its text (``max_new_tokens`` still caps it).
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
        baseline: bool = True,
        stop_below_baseline: int | None = None,
        limit_factor: float = 3.0,
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
        if stop_below_baseline is not None and stop_below_baseline < 1:
            raise ValueError(f"stop_below_baseline must be >= 1 or None, got {stop_below_baseline}")
        if limit_factor <= 0:
            raise ValueError(f"limit_factor must be > 0, got {limit_factor}")
        self.baseline = baseline
        self.stop_below_baseline = stop_below_baseline
        self.limit_factor = float(limit_factor)
        self.baseline_values: dict[str, float | None] | None = None
        self.below_baseline = 0
        self.validation_runs = 0
        self._warned: set[str] = set()
        self._text = None  # text tokenizer, rank 0 only
        self._speech = None  # speech tokenizer, rank 0 only, kept in host memory
        self._index: dict | None = None
        self._references: dict[str, Tensor] = {}
        self._paces: dict[str, float | None] = {}

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
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse, before training, a checkpoint monitor this callback cannot feed: without the
        similarity scorer ``val/speaker_similarity`` is never logged, and `ModelCheckpoint` would fail
        after the first validation. Decided the same way on every rank."""
        if stage != "fit":
            return
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

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The zero-shot baseline, once, with the base weights. A resumed run keeps the one its
        checkpoint saved. Strategies that restore before setup have already loaded the trained weights
        here (``trainer.ckpt_path`` is set): no baseline then. FSDP restores after this hook, so the
        weights here are still the base model's and the baseline is right (the saved one, when there
        is one, replaces it on restore)."""
        if not self.baseline or self.baseline_values is not None or trainer.ckpt_path is not None:
            return
        loggers = self._tensorboard_loggers(trainer)
        scoring = self.similarity and self._similarity_available()
        if not loggers and not scoring:
            return
        values = self._sample_collectively(trainer, pl_module, loggers, scoring, baseline=True)
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
        loggers = self._tensorboard_loggers(trainer)
        scoring = self.similarity and self._similarity_available()
        if not loggers and not scoring:
            return
        values = self._sample_collectively(trainer, pl_module, loggers, scoring, baseline=False)
        if values is None:
            return
        for key, name in METRICS.items():
            value = values.get(key)
            if value is not None:
                # The same value and key on every rank; the epoch-end reduction is entered by all.
                pl_module.log(name, float(value), on_step=False, on_epoch=True, sync_dist=True, batch_size=1)
        self._check_baseline(trainer, values)

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
        metric values (None when nothing was sampled)."""
        values: dict[str, float | None] | None = None
        error: BaseException | None = None
        generated = None
        # Sampling, and building the tokenizers and the encoder (random init before loading), draw
        # from the global RNG: training's stream must not see it.
        try:  # building rank 0's copy can fail too (out of memory): it must reach the broadcast as well
            with generation_model(trainer, pl_module) as model:
                if model is not None:
                    with torch.random.fork_rng(devices=_cuda_devices(pl_module.device)):
                        generated = self._generate(trainer, pl_module, model)
        except Exception as exc:  # raised on every rank below, after the broadcast
            error = exc
        if generated is not None:  # rank 0, the generation copy freed
            try:
                with torch.random.fork_rng(devices=_cuda_devices(pl_module.device)):
                    values = self._log_and_score(trainer, pl_module, generated, loggers, scoring, baseline=baseline)
            except Exception as exc:
                error = exc
        shared = trainer.strategy.broadcast(
            {"values": values, "error": None if error is None else f"{type(error).__name__}: {error}"},
            src=0,
        )
        if error is not None:
            raise error
        if shared["error"] is not None:
            raise RuntimeError(f"SpeakerSamplesCallback failed on rank 0: {shared['error']}")
        return cast("dict[str, float | None] | None", shared["values"])  # rank 0's, broadcast

    # -- rank 0 ---------------------------------------------------------------------------------
    def _generate(self, trainer: pl.Trainer, pl_module: pl.LightningModule, model: nn.Module) -> tuple | None:
        """(rows, codes) for every (speaker, text), or None when no speaker has an embedding yet."""
        speakers, embeddings = self._speaker_rows(trainer, pl_module)
        if not speakers:
            return None
        text_tokenizer = self._text_tokenizer(pl_module)
        from tts_lightning.model.sequence import tokenize_text

        rows = [(s, i) for s in speakers for i in range(len(self.texts))]
        text_ids = [tokenize_text(text_tokenizer, self.texts[i]) for _, i in rows]
        languages = [self._language(trainer, s) for s, _ in rows]
        row_embeddings = torch.stack([embeddings[speakers.index(s)] for s, _ in rows])
        limits = [self._frame_limit(trainer, s, self.texts[i]) for s, i in rows]
        modes = {m: m.training for m in model.modules()}
        model.eval()
        try:
            with torch.no_grad():
                codes = generate_codes(
                    model,
                    text_ids,
                    row_embeddings,
                    languages,
                    max_new_tokens=max_new_tokens_for(max(limits)),
                    seed=self.seed,
                    dtype=cast(Any, model.talker).get_input_embeddings().weight.dtype,
                )
        finally:
            for module, training in modes.items():
                module.training = training
        failures = [hit_frame_limit(c.shape[0], limit) for c, limit in zip(codes, limits)]
        return rows, [c[:limit] for c, limit in zip(codes, limits)], failures

    def _log_and_score(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        generated: tuple,
        loggers: list,
        scoring: bool,
        *,
        baseline: bool = False,
    ) -> dict[str, float | None]:
        rows, codes, failures = generated
        speech_tokenizer = self._speech_tokenizer(pl_module)
        with speech_tokenizer_on(speech_tokenizer, pl_module.device):
            wavs = decode_codes(speech_tokenizer, codes)
        step = int(trainer.global_step)
        samples, spectrograms = (
            ("baseline_samples", "baseline_spectrograms") if baseline else ("samples", "spectrograms")
        )
        for logger in loggers:
            writer = logger.experiment
            for i, text in enumerate(self.texts):
                writer.add_text(f"{samples}/text_{i}", text, step)
            for (speaker, i), wav in zip(rows, wavs):
                if wav.size == 0:
                    continue
                writer.add_audio(
                    f"{samples}/{speaker}/{i}",
                    torch.from_numpy(np.clip(wav, -1.0, 1.0))[None],
                    step,
                    sample_rate=SAMPLE_RATE,
                )
                writer.add_image(f"{spectrograms}/{speaker}/{i}", mel_image(wav), step, dataformats="CHW")
            writer.flush()
        values = {
            "speaker_similarity": self._score(trainer, rows, wavs, loggers, step, baseline) if scoring else None,
            "speaking_rate_ratio": self._rate_ratio(trainer, rows, wavs),
            "eos_failure_rate": sum(failures) / len(failures),
        }
        if baseline:
            for logger in loggers:
                for key, value in values.items():
                    if value is not None:
                        logger.experiment.add_scalar(BASELINE_PREFIX + key, value, step)
                logger.experiment.flush()
        return values

    def _rate_ratio(self, trainer: pl.Trainer, rows: list, wavs: list) -> float | None:
        """Mean over audible samples of their seconds per character over their speaker's."""
        from tts_lightning.metrics.speech import speaking_rate_ratio

        ratios = []
        for (speaker, i), wav in zip(rows, wavs):
            pace = self._pace(trainer, speaker)
            if pace is None or wav.size == 0 or not np.abs(wav).max() > 0:
                continue
            ratios.append(speaking_rate_ratio(wav, self.texts[i], SAMPLE_RATE, pace))
        return float(np.mean(ratios)) if ratios else None

    def _score(self, trainer, rows, wavs, loggers, step, baseline: bool = False) -> float | None:
        from tts_lightning.metrics.speaker_similarity import SpeakerSimilarity

        # Rank 0 alone scores: its metrics must not sync in compute() (a collective the other
        # ranks never enter). The result reaches them through the broadcast.
        overall = SpeakerSimilarity(sample_rate=SAMPLE_RATE, sync_on_compute=False)
        for speaker in dict.fromkeys(s for s, _ in rows):
            generated = [w for (s, _), w in zip(rows, wavs) if s == speaker and w.size and np.abs(w).max() > 0]
            reference = self._reference_embedding(trainer, speaker)
            if reference is None or not generated:
                continue
            one = SpeakerSimilarity(sample_rate=SAMPLE_RATE, sync_on_compute=False)
            one.update(generated, reference)
            overall.update(generated, reference)
            for logger in loggers:
                name = f"{BASELINE_PREFIX}speaker_similarity" if baseline else METRIC_NAME
                logger.experiment.add_scalar(f"{name}/{speaker}", float(one.compute()), step)
        if int(overall.count) == 0:
            self._warn_once(
                "no-score",
                "SpeakerSamplesCallback: no sample could be scored (no reference clips "
                "or only empty audio); val/speaker_similarity is not logged",
            )
            return None
        return float(overall.compute())

    # -- helpers -----------------------------------------------------------------------------------
    def _tensorboard_loggers(self, trainer: pl.Trainer) -> list:
        from lightning.pytorch.loggers import TensorBoardLogger

        found = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not found:
            names = ", ".join(type(lg).__name__ for lg in trainer.loggers) or "none"
            self._warn_once(
                "logger",
                f"SpeakerSamplesCallback logs audio and spectrograms to TensorBoard only; "
                f"the trainer has no TensorBoardLogger (loggers: {names}), so none are logged",
            )
        return found

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
        """Loaded once, in host memory (`speech_tokenizer_on` moves it to the GPU to decode)."""
        if self._speech is None:
            from tts_lightning.model.pretrained import check_pretrained, load_speech_tokenizer

            self._speech = load_speech_tokenizer(check_pretrained(pl_module.hparams["pretrained"]), device="cpu")
        return self._speech

    def _prepared_index(self, trainer: pl.Trainer) -> dict | None:
        """The data module's ``prepared.json`` (speakers, their reference clips, clip languages)."""
        if self._index is None:
            read_index = getattr(getattr(trainer, "datamodule", None), "read_index", None)
            if read_index is None:
                return None
            try:
                self._index = read_index()
            except (OSError, RuntimeError, ValueError) as exc:
                self._warn_once("index", f"SpeakerSamplesCallback cannot read the prepared index: {exc}")
                return None
        return self._index

    def _speaker_rows(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[list[str], Tensor]:
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
        if self.speakers is not None and len(wanted) != len(self.speakers):
            self._warn_once(
                "unknown",
                f"SpeakerSamplesCallback: speakers {sorted(set(self.speakers) - set(names))} "
                f"are not in this run ({names})",
            )
        keep = [s for s in wanted if bool(table[names.index(s)].abs().sum() > 0)]
        if len(keep) != len(wanted):
            self._warn_once(
                "empty", f"SpeakerSamplesCallback: no embedding yet for {sorted(set(wanted) - set(keep))}; not sampled"
            )
        return keep, torch.stack([table[names.index(s)] for s in keep]) if keep else table[:0]

    def _language(self, trainer: pl.Trainer, speaker: str) -> str:
        if self.language:
            return self.language
        index = self._prepared_index(trainer)
        if index is None:
            return "auto"
        from tts_lightning.data.predict import speaker_languages

        return speaker_languages(index).get(speaker, "auto")

    def _reference_embedding(self, trainer: pl.Trainer, speaker: str) -> Tensor | None:
        if speaker not in self._references:
            index = self._prepared_index(trainer)
            entry = next((s for s in (index or {}).get("speakers", []) if s.get("name") == speaker), None)
            if not entry or not entry.get("references"):
                self._warn_once(
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

    def _pace(self, trainer: pl.Trainer, speaker: str) -> float | None:
        """The speaker's seconds of speech per character on its real clips (its reference and
        validation clips, else its first clips; at most `PACE_CLIPS`), None without a prepared index."""
        if speaker not in self._paces:
            index = self._prepared_index(trainer) or {}
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
                    self._warn_once(
                        f"pace-{speaker}",
                        f"SpeakerSamplesCallback: cannot measure {speaker!r}'s pace "
                        f"({exc}); its samples are capped by max_new_tokens only",
                    )
            self._paces[speaker] = pace
        return self._paces[speaker]

    def _frame_limit(self, trainer: pl.Trainer, speaker: str, text: str) -> int:
        """Frames a sample may take before it counts as not ending: from the text and the speaker's
        pace, at most ``max_new_tokens``."""
        from tts_lightning.metrics.speech import frame_limit

        pace = self._pace(trainer, speaker)
        if pace is None:
            return self.max_new_tokens
        return frame_limit(text, pace, factor=self.limit_factor, max_frames=self.max_new_tokens)


def _cuda_devices(device: torch.device) -> list[int]:
    if device.type == "cuda":
        return [device.index if device.index is not None else torch.cuda.current_device()]
    return []
