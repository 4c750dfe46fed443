"""A callback the LoRA tests put into a real `tts-lightning fit` run (imported by the ranks through
PYTHONPATH): after each backward, only the trainable parameters (adapters, extras) hold gradients
(frozen ones have no gradient storage at all); at the end of the run, every frozen weight still
equals the pretrained one. Under FSDP1 and FSDP2."""

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
        import contextlib

        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp._common_utils import clean_tensor_name
        from torch.distributed.tensor import DTensor

        from tts_lightning.model.loading import WeightReader
        from tts_lightning.model.lora import checkpoint_key, is_adapter_key
        from tts_lightning.model.pretrained import check_pretrained
        from tts_lightning.model.row_blocks import row_slices

        reader = WeightReader(check_pretrained(pl_module.hparams.pretrained))
        # the text embedding's row blocks are row slices of the pretrained tensor
        slices = {clean_tensor_name(k): v for k, v in row_slices(pl_module.model).items()}
        checked = moved = 0
        root = trainer.strategy.model
        full = (  # FSDP1: flat shards, gathered here; FSDP2: DTensors, gathered one by one below
            FullyShardedDataParallel.summon_full_params(root, writeback=False)
            if isinstance(root, FullyShardedDataParallel)
            else contextlib.nullcontext()
        )
        with full:
            for name, param in pl_module.model.named_parameters():
                name = clean_tensor_name(name)
                value = param.full_tensor() if isinstance(param, DTensor) else param  # every rank, same order
                if is_adapter_key(name):
                    moved += int(".lora_B." in name and bool(value.abs().sum() > 0))
                    continue
                whole, start, stop = slices.get(name, (name, 0, None))
                expected = reader.read(checkpoint_key(whole))[start:stop].to(value.dtype)
                assert torch.equal(value.detach().cpu(), expected), name
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


class CheckResumed(Callback):
    """After a resume from the full-format checkpoint ``path``, at the start of training: every
    trainable tensor and buffer the checkpoint holds, and the AdamW state of every trainable
    parameter, equal the checkpoint's exactly (FSDP2: gathered from the DTensor shards)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.tensor import DTensor

        def full(t):
            return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()

        saved = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        state, optim = saved["state_dict"], saved["optimizer_states"][0]["state"]
        named = dict(pl_module.named_parameters())
        mine = {**named, **dict(pl_module.named_buffers())}
        trainable = {n for n, p in named.items() if p.requires_grad}
        assert trainable <= set(state), sorted(trainable - set(state))[:5]
        for key, value in state.items():
            assert torch.equal(full(mine[key]), value), key
        # full-format optimizer state: keyed by each parameter's index in module.parameters()
        names = list(named)
        optimizer = trainer.optimizers[0]
        compared = 0
        for key, stored in optim.items():
            param = named[names[key] if isinstance(key, int) else key]
            for name, value in stored.items():
                assert torch.equal(full(optimizer.state[param][name]), value), (key, name)
                compared += 1
        assert compared >= 3 * len(trainable), (compared, len(trainable))
        print(
            f"[CheckResumed] rank {trainer.global_rank}: {len(state)} tensors and {compared} optimizer "
            f"states as saved at step {saved['global_step']}",
            flush=True,
        )
