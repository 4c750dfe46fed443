"""CodebookAccuracyChart: the per-codebook accuracies' mean, and the custom-scalar layout that puts
them in one chart, in a real TensorBoard event file of a short fit."""

import re
from pathlib import Path

import lightning as L
import numpy as np
import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from tts_lightning import Qwen3TTSModule
from tts_lightning.callbacks import CodebookAccuracyChart


def test_layout_and_mean_in_the_event_file(tiny_dir, make_datamodule, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    L.seed_everything(0)
    data = make_datamodule()
    module = Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        val_check_interval=3,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[CodebookAccuracyChart()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)

    (events,) = {p.parent for p in Path(tmp_path).rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    (config,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout()
    layout.ParseFromString(config.tensor_proto.string_val[0])
    (category,) = layout.category
    charts = {c.title: list(c.multiline.tag) for c in category.chart}
    assert category.title == "codebook accuracy"
    assert charts["train (per step)"] == [r"train/acc_codebook_\d+_step", "train/acc_codebook_mean"]
    groups = module.num_code_groups
    tags = acc.Tags()["scalars"]

    assert len([t for t in tags if re.fullmatch(charts["train (per step)"][0], t)]) == groups  # a line each
    assert len([t for t in tags if re.fullmatch(charts["validation"][0], t)]) == groups
    mean = acc.Scalars("train/acc_codebook_mean")
    assert [e.step for e in mean] == [0, 1, 2]  # every logged step
    for event in mean:
        per = [
            next(e.value for e in acc.Scalars(f"train/acc_codebook_{j}_step") if e.step == event.step)
            for j in range(groups)
        ]
        assert event.value == pytest.approx(np.mean(per), abs=1e-6)
    (val,) = acc.Scalars("val/acc_codebook_mean")
    per = [acc.Scalars(f"val/acc_codebook_{j}")[0].value for j in range(groups)]
    assert val.value == pytest.approx(np.mean(per), abs=1e-6)
