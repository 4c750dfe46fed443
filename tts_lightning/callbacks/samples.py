"""`SpeakerSamplesCallback`: hear the run's voices while it trains.

After every N-th validation run it speaks a few fixed texts as each speaker of the run with the
current weights, logs the audio (24 kHz) and a mel spectrogram to TensorBoard at the global step,
and logs ``val/speaker_similarity`` (resemblyzer cosine against the speakers' reference clips) so
that a `ModelCheckpoint` can monitor it.

Under FSDP the weights are flat shards outside the training step. Every rank enters
``FullyShardedDataParallel.summon_full_params(rank0_only=True, offload_to_cpu=True)`` (one
all-gather per unit, on all ranks, in the same order); rank 0 receives the full weights in host
memory, copies them into a plain model in the run's compute dtype on its device (bf16 under
bf16-mixed: 3.6 GiB for the 1.7B, never the 7.2 GiB fp32 model) and generates with it, with no
collective inside generation; the copy is freed before the speech tokenizer, kept in host memory,
visits the GPU to decode. Then every rank takes part in one broadcast of rank 0's result and logs
the same key, so the metric's epoch-end reduction is entered by all ranks. Nothing collective depends on what rank 0 generated, so ranks
cannot fall out of step; if generation fails on rank 0 the failure is broadcast and every rank
raises instead of waiting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from tts_lightning.model.generation import SAMPLE_RATE, decode_codes, generate_codes

DEFAULT_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Please call me back when you get this message.",
)
METRIC_NAME = "val/speaker_similarity"


@contextlib.contextmanager
def generation_model(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Iterator[nn.Module | None]:
    """Collective on all ranks: a plain model to generate with on global rank 0, None elsewhere.

    Under FSDP the full weights are gathered to *host* memory on rank 0 only (the other ranks keep
    their shards), copied into a fresh model in the run's compute dtype (bf16 under bf16-mixed) on
    rank 0's device, and the host copy is released before generation starts: the GPU holds the
    copy (2 bytes per parameter) only while sampling, never the fp32 model. Generation then issues
    no collective at all. Without FSDP the module's own model is used, on rank 0."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    root = trainer.strategy.model
    if not isinstance(root, FullyShardedDataParallel):
        yield pl_module.model if trainer.is_global_zero else None
        return
    from tts_lightning.model.generation import compute_dtype
    from tts_lightning.model.loading import copy_model

    dtype = compute_dtype(pl_module.model)
    with FullyShardedDataParallel.summon_full_params(root, writeback=False, rank0_only=True, offload_to_cpu=True):
        model = copy_model(pl_module.model, dtype=dtype, device=pl_module.device) if trainer.is_global_zero else None
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
        self.validation_runs = 0
        self._warned: set[str] = set()
        self._text = None  # text tokenizer, rank 0 only
        self._speech = None  # speech tokenizer, rank 0 only, kept in host memory
        self._index: dict | None = None
        self._references: dict[str, Tensor] = {}

    # -- state ---------------------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_val_epochs=self.every_n_val_epochs, texts=self.texts)

    def state_dict(self) -> dict[str, Any]:
        return {"validation_runs": self.validation_runs}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.validation_runs = int(state_dict.get("validation_runs", 0))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    # -- the hook ------------------------------------------------------------------------------
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
        similarity: float | None = None
        error: BaseException | None = None
        generated = None
        # Sampling, and building the tokenizers and the encoder (random init before loading), draw
        # from the global RNG: training's stream must not see it.
        with generation_model(trainer, pl_module) as model:
            if model is not None:
                try:
                    with torch.random.fork_rng(devices=_cuda_devices(pl_module.device)):
                        generated = self._generate(trainer, pl_module, model)
                except Exception as exc:  # raised on every rank below, after the broadcast
                    error = exc
        if generated is not None:  # rank 0, the generation copy freed
            try:
                with torch.random.fork_rng(devices=_cuda_devices(pl_module.device)):
                    similarity = self._log_and_score(trainer, pl_module, generated, loggers, scoring)
            except Exception as exc:
                error = exc
        shared = trainer.strategy.broadcast(
            {"similarity": similarity, "error": None if error is None else f"{type(error).__name__}: {error}"},
            src=0,
        )
        if error is not None:
            raise error
        if shared["error"] is not None:
            raise RuntimeError(f"SpeakerSamplesCallback failed on rank 0: {shared['error']}")
        if shared["similarity"] is not None:
            # The same value and key on every rank; the epoch-end reduction is entered by all.
            pl_module.log(METRIC_NAME, float(shared["similarity"]), on_step=False, on_epoch=True,
                          sync_dist=True, batch_size=1)

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
        modes = {m: m.training for m in model.modules()}
        model.eval()
        try:
            with torch.no_grad():
                codes = generate_codes(
                    model, text_ids, row_embeddings, languages, max_new_tokens=self.max_new_tokens,
                    seed=self.seed, dtype=model.talker.get_input_embeddings().weight.dtype,
                )
        finally:
            for module, training in modes.items():
                module.training = training
        return rows, codes

    def _log_and_score(self, trainer: pl.Trainer, pl_module: pl.LightningModule, generated: tuple,
                       loggers: list, scoring: bool) -> float | None:
        rows, codes = generated
        speech_tokenizer = self._speech_tokenizer(pl_module)
        with speech_tokenizer_on(speech_tokenizer, pl_module.device):
            wavs = decode_codes(speech_tokenizer, codes)
        step = int(trainer.global_step)
        for logger in loggers:
            writer = logger.experiment
            for i, text in enumerate(self.texts):
                writer.add_text(f"samples/text_{i}", text, step)
            for (speaker, i), wav in zip(rows, wavs):
                if wav.size == 0:
                    continue
                writer.add_audio(f"samples/{speaker}/{i}", torch.from_numpy(np.clip(wav, -1.0, 1.0))[None],
                                 step, sample_rate=SAMPLE_RATE)
                writer.add_image(f"spectrograms/{speaker}/{i}", mel_image(wav), step, dataformats="CHW")
            writer.flush()
        if not scoring:
            return None
        return self._score(trainer, rows, wavs, loggers, step)

    def _score(self, trainer, rows, wavs, loggers, step) -> float | None:
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
                logger.experiment.add_scalar(f"{METRIC_NAME}/{speaker}", float(one.compute()), step)
        if int(overall.count) == 0:
            self._warn_once("no-score", "SpeakerSamplesCallback: no sample could be scored (no reference clips "
                            "or only empty audio); val/speaker_similarity is not logged")
            return None
        return float(overall.compute())

    # -- helpers -----------------------------------------------------------------------------------
    def _tensorboard_loggers(self, trainer: pl.Trainer) -> list:
        from lightning.pytorch.loggers import TensorBoardLogger

        found = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not found:
            names = ", ".join(type(lg).__name__ for lg in trainer.loggers) or "none"
            self._warn_once("logger", f"SpeakerSamplesCallback logs audio and spectrograms to TensorBoard only; "
                                      f"the trainer has no TensorBoardLogger (loggers: {names}), so none are logged")
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

            self._text = load_text_tokenizer(check_pretrained(pl_module.hparams.pretrained))
        return self._text

    def _speech_tokenizer(self, pl_module: pl.LightningModule):
        """Loaded once, in host memory (`speech_tokenizer_on` moves it to the GPU to decode)."""
        if self._speech is None:
            from tts_lightning.model.pretrained import check_pretrained, load_speech_tokenizer

            self._speech = load_speech_tokenizer(check_pretrained(pl_module.hparams.pretrained), device="cpu")
        return self._speech

    def _prepared_index(self, trainer: pl.Trainer) -> dict | None:
        """The data module's ``prepared.json`` (speakers, their reference clips, clip languages)."""
        if self._index is None:
            read_index = getattr(trainer.datamodule, "read_index", None)
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
        table = pl_module.speaker_embeddings.detach().float().cpu().clone()
        datamodule = trainer.datamodule
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
            self._warn_once("unknown", f"SpeakerSamplesCallback: speakers {sorted(set(self.speakers) - set(names))} "
                                       f"are not in this run ({names})")
        keep = [s for s in wanted if bool(table[names.index(s)].abs().sum() > 0)]
        if len(keep) != len(wanted):
            self._warn_once("empty", f"SpeakerSamplesCallback: no embedding yet for {sorted(set(wanted) - set(keep))}; "
                                     "not sampled")
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
                self._warn_once(f"refs-{speaker}", f"SpeakerSamplesCallback: no reference clips for {speaker!r} "
                                                   "(trainer.datamodule.read_index() gives none); not scored")
                return None
            from tts_lightning.data.audio import load_audio
            from tts_lightning.metrics.speaker_similarity import reference_embedding

            clips = [load_audio(path, SAMPLE_RATE) for path in entry["references"]]
            self._references[speaker] = reference_embedding(clips, SAMPLE_RATE)
        return self._references[speaker]


def _cuda_devices(device: torch.device) -> list[int]:
    if device.type == "cuda":
        return [device.index if device.index is not None else torch.cuda.current_device()]
    return []
