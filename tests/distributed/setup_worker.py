"""Run by tests/distributed/test_real_size_paths.py: `validate` with 2 FSDP ranks (started side by
side by the test, as torchrun would; run alone, Lightning starts the second), and, once the
strategy has set the model up, checks on every rank:

- weights: the meta-built model materialized unit by unit (read on rank 0, broadcast) equals,
  bit for bit, the model loaded the old way (random init + load_state_dict of the whole file);
- devices: every tensor handed to a collective by the strategy's shard report, the speaker-table
  sync and the strategy's reductions is on the root device, checked with the default device set to
  "meta" so that a tensor made without an explicit device (NCCL refuses CPU tensors) is caught;
  the speaker table comes out the same on both ranks, with the rows of both ranks' speakers;
- clipping: Lightning's path (`LightningModule.clip_gradients` -> the strategy's precision plugin)
  clips by the norm of the whole gradient: before clipping, the sharded gradient's norm over both
  ranks equals the norm of a plain model's gradient averaged over both ranks' batches, and after it
  equals the clip value (clipping each rank's shard by its own norm would not);
- codebooks: rank 1's batch has no codebook 1..15 in its codec channel while rank 0's has all; both
  run the forward through FSDP (a rank skipping a unit would hang or fail) and get the loss a plain
  model gives for their batch.

Writes ``<out>/rank<N>.json``.
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import torch
import torch.distributed as dist

from tts_lightning import Qwen3TTSModule, SpeakerClipsDataModule
from tts_lightning.distributed.fsdp import Qwen3TTSFSDPStrategy
from tts_lightning.model.loss import compute_loss
from tts_lightning.model.pretrained import check_pretrained, load_config, load_state_dict
from tts_lightning.model.sequence import NO_CODEC

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce")


class DeviceRecorder:
    """Records the device of every tensor given to torch.distributed's collectives (the real
    collectives still run)."""

    def __init__(self):
        self.seen: list[str] = []
        self._saved = {}

    def __enter__(self):
        for name in COLLECTIVES:
            real = getattr(dist, name)
            self._saved[name] = real

            def spy(tensor, *args, _real=real, **kwargs):
                for t in tensor if isinstance(tensor, (list, tuple)) else [tensor]:
                    self.seen.append(str(t.device))
                return _real(tensor, *args, **kwargs)

            setattr(dist, name, spy)
        return self

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(dist, name, real)


def reference_model(pretrained):
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration

    info = check_pretrained(pretrained)
    model = Qwen3TTSForConditionalGeneration(load_config(info)).float()
    model.load_state_dict({k: v.float() for k, v in load_state_dict(info).items()})
    return model.eval()


def global_norm(tensors, device) -> float:
    """The 2-norm over the tensors of every rank (each rank holding a disjoint part)."""
    local = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        local += t.detach().double().pow(2).sum().to(device)
    dist.all_reduce(local)
    return float(local.sqrt())


def clipping_checks(trainer, pl_module, reference, batch) -> dict:
    from tts_lightning.model.row_blocks import official_key

    strategy = trainer.strategy
    with torch.enable_grad():
        strategy.model(batch).loss.backward()
        trainable = {official_key(k) for k in pl_module.trainable_keys}  # the row blocks: the one embedding
        for name, param in reference.named_parameters():
            param.requires_grad_(f"model.{name}" in trainable)
        compute_loss(reference.talker, batch).loss.backward()
    # The plain model's gradient, averaged over the ranks' batches as FSDP reduces it.
    plain = torch.cat([p.grad.flatten() for p in reference.parameters() if p.grad is not None]).double()
    dist.all_reduce(plain)
    plain /= dist.get_world_size()
    reference.zero_grad(set_to_none=True)
    shards = [p.grad for p in pl_module.parameters() if p.grad is not None]  # this rank's views
    before = global_norm(shards, strategy.root_device)
    clip_val = before / 2
    optimizer = torch.optim.SGD([p for p in pl_module.parameters() if p.requires_grad], lr=0.0)
    pl_module.clip_gradients(optimizer, gradient_clip_val=clip_val, gradient_clip_algorithm="norm")
    after = global_norm(shards, strategy.root_device)
    pl_module.zero_grad(set_to_none=True)
    return {
        "plugin": type(trainer.precision_plugin).__name__,
        "grad_norm_plain": float(plain.norm()),
        "grad_norm_fsdp": before,
        "grad_norm_clipped": after,
        "clip_val": clip_val,
    }


class Checks(L.Callback):
    def __init__(self, out: Path, pretrained: str):
        self.out, self.pretrained = out, pretrained

    def on_validation_start(self, trainer, pl_module):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        from tts_lightning.model.row_blocks import official_state

        strategy, rank = trainer.strategy, trainer.global_rank
        result = {"rank": rank}
        reference = reference_model(self.pretrained)
        with FSDP.state_dict_type(
            strategy.model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        ):
            full = strategy.model.state_dict()
        ref = reference.state_dict()
        # the text embedding's row blocks joined: the layout of the pretrained weights
        mine = official_state({k[len("model.") :]: v for k, v in full.items() if k.startswith("model.")})
        result["weights_keys_equal"] = set(mine) == set(ref)
        result["weights_bit_identical"] = all(torch.equal(mine[k], ref[k]) for k in ref)

        batch = next(iter(trainer.datamodule.val_dataloader()))
        # Rank 0 sees speakers 0 and 1, rank 1 only speaker 1: rank 1 learns row 0 from rank 0 alone,
        # and row 1, seen by both, must be taken from one of them (a plain sum would double it).
        keep = torch.ones_like(batch.speaker_index, dtype=torch.bool) if rank == 0 else batch.speaker_index == 1
        seen = SimpleNamespace(speaker_index=batch.speaker_index[keep], speaker_embedding=batch.speaker_embedding[keep])
        with DeviceRecorder() as recorder, torch.device("meta"):
            strategy._report_shards(strategy.model)
            pl_module.speaker_embeddings.zero_()  # force the speaker-table sync
            pl_module._remember_speakers(seen)
            strategy.reduce_boolean_decision(True, all=True)
        result["collective_devices"] = sorted(set(recorder.seen))
        result["collectives"] = len(recorder.seen)
        result["root_device"] = str(strategy.root_device)
        table = pl_module.speaker_embeddings
        result["batch_speakers"] = sorted({int(i) for i in seen.speaker_index})
        result["prepared_table"] = trainer.datamodule.speaker_embeddings().to(table.dtype).tolist()
        result["speaker_rows_filled"] = [i for i in range(len(table)) if bool(table[i].abs().sum() > 0)]
        result["speaker_table"] = table.tolist()
        result["clipping"] = clipping_checks(trainer, pl_module, reference, batch)

        if rank == 1:  # no codebook 1..15 anywhere in this rank's codec channel
            batch.codec_ids[..., 1:] = NO_CODEC
        result["codebooks_present"] = int((batch.codec_ids != NO_CODEC).any(dim=(0, 1)).sum())
        with torch.no_grad():
            sharded = strategy.model(batch).loss.item()
            plain = compute_loss(reference.talker, batch).loss.item()
        result["loss_fsdp"], result["loss_plain"] = sharded, plain
        (self.out / f"rank{rank}.json").write_text(json.dumps(result))


def main(pretrained, manifest, cache, out):
    out = Path(out)
    data = SpeakerClipsDataModule(
        pretrained, manifest, val_fraction=0.15, cache_dir=cache, seed=0, max_frames_per_batch=150
    )
    module = Qwen3TTSModule(pretrained, speakers=data.speaker_names)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=Qwen3TTSFSDPStrategy(),
        precision="32-true",
        limit_val_batches=1,
        inference_mode=False,  # validation under no_grad only: the clipping check runs a backward
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[Checks(out, pretrained)],
    )
    trainer.validate(module, datamodule=data)


if __name__ == "__main__":
    main(*sys.argv[1:5])
