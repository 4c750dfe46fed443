"""`Qwen3TTSModule`: the LightningModule that fine-tunes a Qwen3-TTS Base model on new voices."""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Literal, Sequence

import lightning as L
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from tts_lightning.model.loss import LossOutput, compute_loss
from tts_lightning.model.pretrained import build_model, check_pretrained
from tts_lightning.model.sequence import TalkerBatch

DEFAULT_FREEZE = ("speaker_encoder",)


def matches(name: str, patterns: Sequence[str]) -> bool:
    """A parameter name matches a pattern naming it, a module above it, or a glob over it."""
    return any(
        name == p or name.startswith(p + ".") or fnmatch.fnmatchcase(name, p) for p in patterns
    )


class Qwen3TTSModule(L.LightningModule):
    """Talker + code-predictor fine-tuning with the loss of `tts_lightning.model.loss`.

    Args:
        pretrained: a Qwen3-TTS 12 Hz *Base* directory or hub id (the tiny model works too).
        speakers: the run's speaker names, in the order of the data module's speaker indices.
        learning_rate: peak AdamW learning rate. Low rates keep the base model's speaker
            similarity; watch ``val/speaker_similarity`` to pick a checkpoint.
        weight_decay: AdamW decoupled weight decay.
        warmup_steps: linear warm-up, in optimizer steps.
        lr_schedule: ``constant`` after warm-up, or ``cosine`` decay to zero at the last step.
        sub_talker_loss_weight: weight of the code-predictor loss (0.3 as upstream).
        freeze: parameter-name patterns kept fixed (module prefixes or globs), e.g.
            ``talker.model.text_embedding`` to save the memory of its gradient and optimizer state.
        attn_implementation: ``sdpa`` (default) or ``eager``; flash-attn is never required.
    """

    def __init__(
        self,
        pretrained: str,
        speakers: list[str] | None = None,
        learning_rate: float = 2e-5,
        weight_decay: float = 0.01,
        warmup_steps: int = 0,
        lr_schedule: Literal["constant", "cosine"] = "constant",
        sub_talker_loss_weight: float = 0.3,
        freeze: list[str] = list(DEFAULT_FREEZE),
        attn_implementation: Literal["sdpa", "eager"] = "sdpa",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        info = check_pretrained(pretrained, require_type="base")  # fail before any process spawns
        talker_cfg = info.config["talker_config"]
        self.num_code_groups = int(talker_cfg["num_code_groups"])
        self.model: nn.Module | None = None
        self.speakers = list(speakers or [])
        # The fp32 speaker embeddings the run trains with, saved in every checkpoint so that export
        # writes exactly these vectors into the new speakers' codec-embedding rows.
        self.register_buffer(
            "speaker_embeddings", torch.zeros(len(self.speakers), int(talker_cfg["hidden_size"]))
        )
        metric = lambda n: MulticlassAccuracy(n, top_k=1, average="micro", ignore_index=-100)  # noqa: E731
        self.accuracy = nn.ModuleDict(
            {
                stage: nn.ModuleList(
                    [metric(int(talker_cfg["vocab_size"]))]
                    + [metric(int(talker_cfg["code_predictor_config"]["vocab_size"]))
                       for _ in range(self.num_code_groups - 1)]
                )
                for stage in ("train_acc", "val_acc", "test_acc")
            }
        )

    # -- construction ------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Build the model here, not in __init__, so that FSDP can wrap it as it is created."""
        if self.model is not None:
            return
        info = check_pretrained(self.hparams.pretrained, require_type="base")
        model = build_model(info, attn_implementation=self.hparams.attn_implementation)
        for name, param in model.named_parameters():
            param.requires_grad_(not matches(name, self.hparams.freeze))
        self.model = model

    @property
    def talker(self) -> nn.Module:
        return self.model.talker

    # -- steps -------------------------------------------------------------------------------
    def forward(self, batch: TalkerBatch) -> LossOutput:
        return compute_loss(self.talker, batch, self.hparams.sub_talker_loss_weight)

    def _shared_step(self, batch: TalkerBatch, stage: str) -> torch.Tensor:
        if len(self.speakers):
            with torch.no_grad():
                self.speaker_embeddings[batch.speaker_index] = batch.speaker_embedding.to(
                    self.speaker_embeddings.dtype
                )
        out = self(batch)
        on_step = stage == "train"
        log = dict(batch_size=len(batch), sync_dist=True, on_step=on_step, on_epoch=True)
        self.log(f"{stage}/loss", out.loss, prog_bar=True, **log)
        self.log(f"{stage}/talker_loss", out.talker_loss, **log)
        self.log(f"{stage}/code_predictor_loss", out.code_predictor_loss, **log)
        metrics = self.accuracy[f"{stage}_acc"]
        metrics[0](out.talker_logits.detach(), out.talker_targets)
        self.log(f"{stage}/acc_codebook_0", metrics[0], on_step=on_step, on_epoch=True,
                 batch_size=len(batch))
        for j in range(self.num_code_groups - 1):
            metrics[j + 1](out.predictor_logits[:, j].detach(), out.predictor_targets[:, j])
            self.log(f"{stage}/acc_codebook_{j + 1}", metrics[j + 1], on_step=on_step,
                     on_epoch=True, batch_size=len(batch))
        return out.loss

    def training_step(self, batch: TalkerBatch, batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch: TalkerBatch, batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "val")

    def test_step(self, batch: TalkerBatch, batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "test")

    # -- optimisation ------------------------------------------------------------------------
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """The Trainer's ``gradient_clip_val``, also under FSDP: Lightning's FSDP precision refuses
        norm clipping, and only the FSDP root can compute the norm over all shards."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = self.trainer.strategy.model
        if gradient_clip_val and isinstance(wrapped, FullyShardedDataParallel):
            if gradient_clip_algorithm not in (None, "norm"):
                raise ValueError("under FSDP only gradient_clip_algorithm='norm' is supported")
            wrapped.clip_grad_norm_(gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> dict[str, Any]:
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay
        )
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup = self.hparams.warmup_steps
        cosine = self.hparams.lr_schedule == "cosine"

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            if not cosine:
                return 1.0
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
