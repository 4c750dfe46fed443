"""SpeakerSamplesCallback with ``asr``: the samples transcribed by the recognizer `evaluate --asr`
uses (pocketsphinx here: offline, ships its model), ``val/cer`` and ``val/wer`` logged through
Lightning into the TensorBoard event file, the transcripts beside the audio."""

import lightning as L
import numpy as np
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from test_samples import SPEAKERS, read_events

from tts_lightning import Qwen3TTSModule
from tts_lightning.callbacks import SpeakerSamplesCallback
from tts_lightning.errors import ConfigError
from tts_lightning.evaluation.asr import error_rates

TEXT = "Good morning."


@pytest.mark.slow
def test_samples_log_cer_and_wer_from_pocketsphinx(tiny_dir, make_datamodule, tmp_path):
    L.seed_everything(0)
    data = make_datamodule()
    module = Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names)
    samples = SpeakerSamplesCallback(
        texts=[TEXT], max_new_tokens=8, similarity=False, baseline=False, asr="pocketsphinx"
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        val_check_interval=1,
        limit_train_batches=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[samples],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)

    acc = read_events(tmp_path / "tb")
    heard = [
        acc.Tensors(f"samples/{s}/0/transcript/text_summary")[0].tensor_proto.string_val[0].decode() for s in SPEAKERS
    ]
    # The logged rates are the mean of the speakers' samples' rates against the text, as jiwer scores
    # their transcripts ("(nothing)": the recognizer heard no word).
    for key in ("cer", "wer"):
        (event,) = acc.Scalars(f"val/{key}")  # through Lightning (monitorable), once per sampled validation
        expected = np.mean([error_rates(TEXT, "" if h == "(nothing)" else h)[key] for h in heard])
        assert event.value == pytest.approx(expected, abs=1e-6)
        # The random tiny model's noise is not speech: the recognizer hears (almost) none of the text.
        assert event.value >= 0.7
        assert f"val/{key}" in trainer.callback_metrics


def test_asr_setting_is_checked_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"asr: .*nowhere is not a Whisper checkpoint folder"):
        SpeakerSamplesCallback(asr=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="asr must be 'pocketsphinx' or a Whisper checkpoint"):
        SpeakerSamplesCallback(asr="")
