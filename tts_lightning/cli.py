"""`tts-lightning fit|validate|test|predict --config ...`: LightningCLI for Qwen3-TTS voice cloning.

The data module owns the pretrained path and the speaker list; the model receives both through
``link_arguments`` so a config never states them twice. The run directory describes itself: the
resolved config is saved next to the TensorBoard logs and checkpoints.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar
from jsonargparse import lazy_instance
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger

from tts_lightning.data.datamodule import SpeakerClipsDataModule
from tts_lightning.model.module import Qwen3TTSModule


def _speaker_names(data: SpeakerClipsDataModule) -> list[str]:
    return list(data.speaker_names)


def _checkpoint_dir(default_root_dir: str | None) -> str:
    # One stable folder per run directory, not one per logger version, so that
    # `--ckpt_path last` finds the checkpoint an interrupted run left.
    return os.path.join(default_root_dir or "runs", "checkpoints")


class TTSLightningCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.pretrained", "model.pretrained")
        parser.link_arguments("data", "model.speakers", compute_fn=_speaker_names, apply_on="instantiate")
        # Checkpointing is part of every run and tunable from YAML under `checkpoint:`.
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=_checkpoint_dir)
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/loss",
                "checkpoint.mode": "min",
                "checkpoint.save_last": True,
                "checkpoint.save_top_k": 2,
                "checkpoint.filename": "step{step:06d}-val_loss{val/loss:.4f}",
                "checkpoint.auto_insert_metric_name": False,
            }
        )


def trainer_defaults() -> dict[str, Any]:
    """The default logger (a config's ``trainer.logger`` replaces it) and callbacks."""
    return {
        "default_root_dir": "runs",
        "logger": lazy_instance(TensorBoardLogger, save_dir="runs", name="qwen3-tts"),
        "callbacks": [
            lazy_instance(LearningRateMonitor, logging_interval="step"),
            lazy_instance(RichProgressBar),
        ],
    }


def cli_main(
    args: list[str] | None = None, *, run: bool = True, cli_class: type[TTSLightningCLI] = TTSLightningCLI
) -> TTSLightningCLI:
    """The CLI every entry point builds (`fit` and friends, `ray-fit` workers, config tests)."""
    return cli_class(
        Qwen3TTSModule,
        SpeakerClipsDataModule,
        trainer_defaults=trainer_defaults(),
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
