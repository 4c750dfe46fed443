"""A callback the FSDP2 tests put into real `tts-lightning fit` runs (imported by the ranks through
PYTHONPATH): it records each rank's per-step loss and gradient norms before and after clipping, and
under FSDP2 checks the sharded state (frozen parameters without gradients, DTensor gradients, the
MRoPE ``inv_freq`` buffers fp32 and equal to a model built normally), and how many text-embedding
row blocks are gathered at once in each backward."""

import json
from pathlib import Path

import torch
from lightning.pytorch import Callback


def _total_norm(grads) -> float:
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm(grads)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


class RecordSteps(Callback):
    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.steps: list[dict] = []
        self.checked = False

    def _fsdp2(self, trainer) -> bool:
        from tts_lightning.distributed.fsdp2 import Qwen3TTSFSDP2Strategy

        return isinstance(trainer.strategy, Qwen3TTSFSDP2Strategy)

    def on_fit_start(self, trainer, pl_module) -> None:
        """Under FSDP2, whenever a row block's output gets its gradient (after FSDP's pre-backward
        hook gathered that block), count the blocks gathered (their weight a plain tensor, not the
        DTensor shard): each block must be freed after its own backward, not at the end of it.
        Under either strategy, record whether the codec embeddings are gathered when each talker
        decoder layer's output gets its gradient, from the last layer (early in the backward) to
        the first (the planner holds them through the backward: `plan._step_transients`)."""
        self.gathered = 0
        self.codec_gathered: list[list[str]] = []
        from torch.distributed.tensor import DTensor

        talker = pl_module.model.talker
        codec = {"talker.model.codec_embedding": talker.model.codec_embedding}
        for i, m in enumerate(talker.code_predictor.model.codec_embedding):
            codec[f"talker.code_predictor.model.codec_embedding.{i}"] = m
        shapes = {name: (m.num_embeddings, m.embedding_dim) for name, m in codec.items()}

        def codec_seen(grad):  # FSDP1 presents a sharded weight as a flat view, FSDP2 as a DTensor
            whole = [n for n, m in codec.items() if not isinstance(m.weight, DTensor) and m.weight.shape == shapes[n]]
            self.codec_gathered.append(whole)

        def layer_hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if hidden.requires_grad:
                hidden.register_hook(codec_seen)

        for layer in pl_module.model.talker.model.layers:
            layer.register_forward_hook(layer_hook)
        if not self._fsdp2(trainer):
            return

        from tts_lightning.model.row_blocks import EmbeddingRowBlock

        blocks = [m for m in pl_module.modules() if isinstance(m, EmbeddingRowBlock)]

        def count(grad):
            self.gathered = max(self.gathered, sum(not isinstance(b.weight, DTensor) for b in blocks))

        def hook(module, args, output):
            if output.requires_grad:  # registered after FSDP's own hook on the output: runs after it
                output.register_hook(count)

        for block in blocks:
            block.register_forward_hook(hook)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.gathered = 0
        self.codec_gathered = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self._fsdp2(trainer):
            return
        from torch.distributed.tensor import DTensor

        frozen = trainable = 0
        for name, param in pl_module.named_parameters():
            assert isinstance(param, DTensor), name
            if not param.requires_grad:
                assert param.grad is None, f"frozen {name} has gradient storage"
                frozen += 1
            elif param.grad is not None:
                assert isinstance(param.grad, DTensor) and param.grad.placements == param.placements, name
                trainable += 1
        assert frozen > 0 and trainable > 0, (frozen, trainable)
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.pre_clip = _total_norm(grads)
        if not self.checked:
            self._check_buffers(pl_module)
            self.checked = True

    def _check_buffers(self, pl_module) -> None:
        from tts_lightning.model.loading import build_empty_model
        from tts_lightning.model.pretrained import check_pretrained

        reference = dict(build_empty_model(check_pretrained(pl_module.hparams.pretrained)).named_buffers())
        mine = dict(pl_module.model.named_buffers())
        assert reference.keys() == mine.keys() and any("inv_freq" in k for k in mine), sorted(mine)
        for key, value in reference.items():
            assert mine[key].dtype == torch.float32, (key, mine[key].dtype)
            torch.testing.assert_close(mine[key].cpu(), value, rtol=0, atol=0, msg=key)
        print(f"[fsdp2-check] rank {pl_module.global_rank}: frozen without grads, buffers ok", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = {"step": trainer.global_step, "loss": float(outputs["loss"]), "codec_gathered": self.codec_gathered}
        if self._fsdp2(trainer):  # the gradients are still there, clipped, until the next step's zero_grad
            step["pre_clip"] = self.pre_clip
            step["post_clip"] = _total_norm([p.grad for p in pl_module.parameters() if p.grad is not None])
            step["gathered_blocks"] = self.gathered
        self.steps.append(step)

    def on_train_end(self, trainer, pl_module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"steps-rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))
        (self.out / f"units-rank{trainer.global_rank}.json").write_text(json.dumps(_units(trainer.strategy.model)))


def _units(root) -> list[str]:
    """The names (wrapper prefixes removed) of the FSDP units of either strategy."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    names = [n for n, m in root.named_modules() if isinstance(m, (FSDPModule, FullyShardedDataParallel))]
    return [clean_tensor_name(n).removesuffix("._fsdp_wrapped_module") for n in names]
