"""FSDP2's validation, test and predict run under `torch.no_grad`, not `torch.inference_mode`.

Lightning runs `validate`, `test` and `predict` under inference mode except over a process group
whose backend is exactly ``"gloo"`` or under its FSDP1 strategy
(`lightning.pytorch.loops.utilities._no_grad_context`; a fit's validation always runs under
no_grad): on GPUs (NCCL, or ``"cpu:gloo,cuda:nccl"`` with ``cpu_offload``) FSDP2 chose inference
mode, and at world size 1 (configs/qwen3-tts-0.6b-1gpu-fsdp2.yaml) its first all-gather failed
there ("Inference tensors do not track version counter"). The CPU rehearsal takes Lightning's GPU
decision: its gloo exception is switched off for the test (the process group itself stays gloo)."""

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from tts_lightning import Qwen3TTSModule
from tts_lightning.distributed.fsdp2 import Qwen3TTSFSDP2Strategy


class RecordGradModes(Callback):
    """Whether each validation batch ran under inference mode, and with gradients off."""

    def __init__(self) -> None:
        self.modes: list[tuple[bool, bool]] = []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))


def test_fsdp2_evaluates_under_no_grad_where_lightning_would_choose_inference_mode(
    tiny_dir, make_datamodule, tmp_path, monkeypatch
):
    import lightning.pytorch.loops.utilities as loop_utilities

    # What Lightning decides on a GPU: not the gloo exception (the NCCL one has none).
    monkeypatch.setattr(loop_utilities, "_distributed_is_initialized", lambda: False)
    data, record = make_datamodule(), RecordGradModes()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=Qwen3TTSFSDP2Strategy(state_dict_type="sharded"),
        use_distributed_sampler=False,
        limit_val_batches=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    assert trainer.validate_loop.inference_mode  # Lightning's default: the test's premise
    trainer.validate(Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names), datamodule=data)
    assert record.modes == [(False, False)], record.modes
    assert not trainer.test_loop.inference_mode and not trainer.predict_loop.inference_mode
