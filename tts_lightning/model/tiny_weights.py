"""The tiny directory's random weights: drawn at unit fan-in scale, and the speech tokenizer's
codebooks filled so that it encodes and decodes real-looking codes and audio."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _fan_in_init(module: nn.Module, generator: torch.Generator) -> None:
    """Redraw weights at unit fan-in scale. The default 0.02-std init makes every logit ~0 so that
    every target costs ~log V and a misaligned loss is indistinguishable from an aligned one."""
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Conv1d, nn.ConvTranspose1d)):
            w = sub.weight
            fan_in = w.shape[1] * (w[0, 0].numel() if w.dim() > 2 else 1)
            if isinstance(sub, nn.ConvTranspose1d):
                fan_in = w.shape[0] * w[0, 0].numel()
            with torch.no_grad():
                w.copy_(torch.randn(w.shape, generator=generator) / math.sqrt(fan_in))
                if sub.bias is not None:
                    sub.bias.copy_(torch.randn(sub.bias.shape, generator=generator) * 0.02)
        elif isinstance(sub, nn.Embedding):
            with torch.no_grad():
                sub.weight.copy_(torch.randn(sub.weight.shape, generator=generator))


def _init_speech_tokenizer(model: nn.Module, generator: torch.Generator) -> None:
    # Codebook sums start at zero (every code 0, silent audio): fill them and mark them used.
    for name, sub in model.named_modules():
        for attr in ("embed_sum", "embedding_sum"):
            t = getattr(sub, attr, None)
            if isinstance(t, torch.Tensor):
                with torch.no_grad():
                    t.copy_(torch.randn(t.shape, generator=generator))
        usage = getattr(sub, "cluster_usage", None)
        if isinstance(usage, torch.Tensor):
            with torch.no_grad():
                usage.fill_(1.0)
        for attr in ("initialized",):
            t = getattr(sub, attr, None)
            if isinstance(t, torch.Tensor):
                with torch.no_grad():
                    t.fill_(1.0)
    # A fan-in redraw of the decoder saturates its output; the final conv is scaled down so the
    # decoded audio stays inside [-1, 1] without clipping most samples.
    decoder: Any = model.decoder
    last_conv = decoder.decoder[-1].conv
    with torch.no_grad():
        last_conv.weight.mul_(0.05)
