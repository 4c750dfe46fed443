"""Run by tests/distributed/test_optimizers.py on 2 ranks (started side by side, as torchrun would):
every `model.optimizer` option trains the tiny model with one FSDP strategy, several fits in one
process group (one launch per strategy keeps the suite fast).

For each option: a fit of ``STEPS`` optimizer steps checkpointed (sharded) at step ``FIRST``: its
per-step losses, which parameters changed, the dtypes of weights and optimizer state. For the options
in ``RESUMED``: a fresh module resumed from that sharded checkpoint, writing a full (one-file)
checkpoint at step ``SECOND``, and another fresh module resumed from that one; both must end with the
uninterrupted fit's weights, bit for bit (this rank's shards are compared). A LoRA fit follows.

Usage: optimizer_worker.py <fsdp1|fsdp2> <pretrained> <manifest> <cache> <out> <option,...> <resumed,...>
Writes ``<out>/rank<N>.json``.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tts_lightning import Qwen3TTSModule, SpeakerClipsDataModule

STEPS, FIRST, SECOND = 4, 2, 3
HOST_GROUP_CALLS: list[str] = []  # "setup" or "training": when `rank_local_state.host_group` was called
PHASE: list[bool] = []  # non-empty once training has started


def _count_host_group_calls() -> None:
    """Records each call of the group that quantized state is gathered over for full checkpoints."""
    from tts_lightning.distributed import rank_local_state

    host_group = rank_local_state.host_group

    def counted():
        HOST_GROUP_CALLS.append("training" if PHASE else "setup")
        return host_group()

    rank_local_state.host_group = counted


class Record(L.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def strategy(kind: str, state_dict_type: str):
    if kind == "fsdp1":
        from tts_lightning.distributed.fsdp import Qwen3TTSFSDPStrategy

        return Qwen3TTSFSDPStrategy(state_dict_type=state_dict_type)
    from tts_lightning.distributed.fsdp2 import Qwen3TTSFSDP2Strategy

    return Qwen3TTSFSDP2Strategy(state_dict_type=state_dict_type)


def local_params(module) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp._common_utils import clean_tensor_name
    from torch.distributed.tensor import DTensor

    return {
        clean_tensor_name(n): (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in module.named_parameters()
    }


def fit(kind, option, pretrained, paths, out: Path, *, steps, every, fmt, ckpt=None, adapter=None):
    L.seed_everything(0)
    manifest, cache = paths
    data = SpeakerClipsDataModule(
        pretrained, manifest, val_fraction=0.15, cache_dir=cache, seed=0, max_frames_per_batch=150
    )
    module = Qwen3TTSModule(
        pretrained, speakers=data.speaker_names, learning_rate=1e-3, optimizer=option, adapter=adapter
    )
    record = Record()
    saver = ModelCheckpoint(
        dirpath=out, every_n_train_steps=every, save_top_k=-1, filename="step{step}", auto_insert_metric_name=False
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy(kind, fmt),
        precision="bf16-mixed" if option.startswith("bf16_sr") else "32-true",
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[record, saver],
    )
    before: dict[str, torch.Tensor] = {}

    class Before(L.Callback):
        def on_train_start(self, trainer, pl_module):
            before.update(local_params(pl_module))
            PHASE.append(True)

    trainer.callbacks.append(Before())
    HOST_GROUP_CALLS.clear()
    PHASE.clear()
    trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    after = local_params(module)
    optimizer = trainer.optimizers[0]
    state_types = sorted(
        {type(getattr(v, "_local_tensor", v)).__name__ for s in optimizer.state.values() for v in s.values()}
    )
    plain = [getattr(v, "_local_tensor", v) for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    moment_dtypes = sorted({str(v.dtype) for v in plain if type(v) is torch.Tensor})  # the unquantized ones
    trainable = module.trainable_keys
    changed = sorted(n for n in after if n in before and not torch.equal(before[n], after[n]))
    return after, {
        "host_group_calls": list(HOST_GROUP_CALLS),
        "losses": record.losses,
        "changed": changed,
        "trainable_changed": sum(n in trainable for n in changed),
        "frozen_changed": [n for n in changed if n not in trainable],
        "trainable": len(trainable),
        "weight_dtypes": sorted({str(p.dtype) for n, p in after.items() if n in trainable}),
        "state_types": state_types,
        "moment_dtypes": moment_dtypes,
    }


def main(kind, pretrained, manifest, cache, out, options, resumed):
    _count_host_group_calls()
    out = Path(out)
    data = (manifest, cache)
    results: dict = {}
    rank = 0
    for option in [o for o in options.split(",") if o]:
        run = out / option
        final, results[option] = fit(kind, option, pretrained, data, run / "a", steps=STEPS, every=FIRST, fmt="sharded")
        rank = torch.distributed.get_rank()
        if option in resumed.split(","):
            first = run / "a" / f"step{FIRST}.ckpt"
            from_sharded, full_run = fit(
                kind, option, pretrained, data, run / "b", steps=STEPS, every=SECOND, fmt="full", ckpt=first
            )
            results[option]["host_group_calls_full"] = full_run["host_group_calls"]
            second = run / "b" / f"step{SECOND}.ckpt"
            from_full, _ = fit(
                kind, option, pretrained, data, run / "c", steps=STEPS, every=99, fmt="full", ckpt=second
            )
            results[option]["resumed_from"] = {"sharded": first.is_dir(), "full": second.is_file()}
            results[option]["resume_sharded_differ"] = [n for n in final if not torch.equal(final[n], from_sharded[n])]
            results[option]["resume_full_differ"] = [n for n in final if not torch.equal(final[n], from_full[n])]
    # LoRA: only the adapters (and the trainable head) train; FSDP1 with 8-bit moments, FSDP2 with
    # bf16 weights, stochastic rounding and 8-bit moments.
    if True:
        _, results["lora"] = fit(
            kind,
            "adamw8bit" if kind == "fsdp1" else "bf16_sr_adamw8bit",
            pretrained,
            data,
            out / "lora",
            steps=2,
            every=99,
            fmt="sharded",
            adapter={"rank": 4, "trainable": ["talker.codec_head"]},
        )
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:8])
