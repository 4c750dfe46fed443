"""A callback the LoRA tests put into a real `tts-lightning fit` run (imported by the ranks through
PYTHONPATH): after each backward, only the trainable parameters (adapters, extras) hold gradients;
at the end of the run, every frozen weight still equals the pretrained one."""

import torch
from lightning.pytorch import Callback


class CheckFrozen(Callback):
    def __init__(self) -> None:
        self.backwards = 0

    def on_after_backward(self, trainer, pl_module) -> None:
        with_grad = {n for n, p in pl_module.named_parameters() if p.grad is not None}
        frozen = {n for n, p in pl_module.named_parameters() if not p.requires_grad}
        assert frozen and not (with_grad & frozen), sorted(with_grad & frozen)[:5]
        assert with_grad and all(".lora_" in n for n in with_grad), sorted(with_grad)[:5]
        self.backwards += 1

    def on_train_end(self, trainer, pl_module) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp._common_utils import clean_tensor_name

        from tts_lightning.model.loading import WeightReader
        from tts_lightning.model.lora import checkpoint_key, is_adapter_key
        from tts_lightning.model.pretrained import check_pretrained

        reader = WeightReader(check_pretrained(pl_module.hparams.pretrained))
        checked = moved = 0
        with FullyShardedDataParallel.summon_full_params(trainer.strategy.model, writeback=False):
            for name, param in pl_module.model.named_parameters():
                name = clean_tensor_name(name)
                if is_adapter_key(name):
                    moved += int(".lora_B." in name and bool(param.abs().sum() > 0))
                    continue
                assert torch.equal(param.detach().cpu(), reader.read(checkpoint_key(name)).float()), name
                checked += 1
        assert checked and moved and self.backwards
        print(
            f"[CheckFrozen] rank {trainer.global_rank}: {checked} frozen weights unchanged, "
            f"{moved} lora_B moved, {self.backwards} backward passes checked",
            flush=True,
        )


class ReportDtypes(Callback):
    """Prints the storage dtypes of the frozen and of the trainable parameters once training starts."""

    def on_train_start(self, trainer, pl_module) -> None:
        frozen = {p.dtype for p in pl_module.parameters() if not p.requires_grad}
        trainable = {p.dtype for p in pl_module.parameters() if p.requires_grad}
        print(
            f"[ReportDtypes] rank {trainer.global_rank}: frozen {', '.join(map(str, sorted(frozen, key=str)))}, "
            f"trainable {', '.join(map(str, sorted(trainable, key=str)))}",
            flush=True,
        )
