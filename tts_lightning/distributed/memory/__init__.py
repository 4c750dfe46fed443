"""Per-GPU memory planner for fine-tuning Qwen3-TTS with `Qwen3TTSFSDPStrategy` (FSDP1) or
`Qwen3TTSFSDP2Strategy` (FSDP2, ``layout="fsdp2"``).

Sizes are never read from a table: the real `Qwen3TTSForConditionalGeneration` is built on the meta
device from a config (a preset written below from the published architecture, a pretrained
directory's ``config.json``, or a config dict), and the FSDP units are found by applying the
strategy's own wrap policy to that module tree.

What is modelled, per GPU (bytes; GiB = 2**30 in the table and for ``gpu_memory_gb``):

* **Model states** (persistent; AdamW, fp32 master weights under both precisions):
  parameters 4 B, gradients 4 B, optimizer states 8 B (``exp_avg`` + ``exp_avg_sq``), each divided
  by the number of GPUs for FULL_SHARD / SHARD_GRAD_OP, replicated for NO_SHARD (FSDP1 also falls
  back to NO_SHARD on one GPU). Frozen parameters keep their 4 B but have no optimizer state.
  Gradients are modelled per FSDP unit, as FSDP (``use_orig_params=True``) holds them: a unit
  whose parameters are all frozen has no gradient; a unit that mixes frozen and trainable
  parameters keeps a gradient for the *whole* flat parameter, frozen part included (e.g. a frozen
  ``talker.text_projection`` in the root unit next to the trainable heads). The default wrap makes
  the frozen speaker encoder and a frozen ``text_embedding``'s row blocks units of their own: they cost no
  gradient. FSDP's padding of flat parameters to a multiple of the world size is ignored (< N elements
  per unit).
* **Gathered parameters** (transient, compute dtype: 2 B under bf16-mixed, 4 B under 32-true):
  the root unit (everything outside the wrapped classes) is gathered for the whole step and its
  unsharded gradient lives through the whole backward; other units are gathered one at a time,
  with at most one more prefetched (``limit_all_gathers``), and each one's unsharded gradient exists
  in the compute dtype plus an fp32 copy for the reduce-scatter (``reduce_dtype`` fp32).
  SHARD_GRAD_OP keeps every unit gathered from its forward until its backward, so all parameters
  in the compute dtype at the peak.
* **Activations**: see `_activation_bytes`; the constants were counted on the real layer classes.
* **Peak** = model states + overhead + the larger of two phases: (a) the start of backward, with all
  activations alive, the root unit and two decoder-layer units gathered; (b) the end of backward,
  when activations are freed but the largest unit (a row block of the 311M-parameter
  ``text_embedding``, 1/``text_embedding_blocks`` of it, or a decoder layer: `tts_lightning.model.row_blocks`)
  is gathered with its unsharded gradient.
* **cpu_offload**: sharded parameters, gradients and optimizer states live in host memory (the
  optimizer steps there); the GPU keeps gathered units, unsharded gradients in flight, activations.
* **Overhead**: a constant 1 GiB for the CUDA context, cuBLAS/cuDNN/NCCL workspaces and caching-
  allocator fragmentation. It is not measured; real fragmentation can be larger.

* **LoRA** (``adapter``): the adapters are injected with peft into the meta model, so their
  parameters are counted exactly; each adapter matrix (and each leaf module trained in full,
  ``adapter.trainable``) is an FSDP unit of its own, as `Qwen3TTSFSDPStrategy` wraps them, so only
  they have gradients (4 B) and AdamW states (8 B). The frozen base is stored in the run's
  precision (``adapter.base_dtype: auto``): 2 B per parameter under bf16-mixed, 4 B under 32-true,
  sharded like any parameter. The adapters' own activations (r values per token per adapted
  layer) are not modelled. Under FSDP2 the adapters stay in their layers' units (frozen parameters
  have no gradient there), and the frozen base is sharded in the same storage dtype (as
  `Qwen3TTSFSDP2Strategy` casts it on the meta device before ``fully_shard``).

* **FSDP2** (``layout="fsdp2"``; `Qwen3TTSFSDP2Strategy`, ``fully_shard``): units as that strategy
  builds them (each decoder layer of both classes; the codec embeddings together; the text
  embedding; the speaker encoder; the root). Each parameter is sharded on dim 0 and padded per
  parameter to a multiple of the world size (counted). Frozen parameters have no gradient at all,
  wherever they sit, so a unit that mixes frozen and trainable parameters holds gradients (sharded,
  and unsharded in flight) for its trainable ones only: that is the difference from FSDP1. Under
  bf16-mixed the gathered parameters are bf16, master weights fp32, gradients reduced in fp32;
  buffers are never cast (and, as under FSDP1, not counted). ``reshard_after_forward: true`` is
  planned as FULL_SHARD, ``false`` as SHARD_GRAD_OP; there is no NO_SHARD switch on one GPU, and the
  gathered copies are counted there too (an upper bound under 32-true). The speaker encoder's unit
  is never gathered in training (the step does not run it). A trainable parameter the step never
  uses is still counted with its gradient and AdamW state (the speaker encoder is frozen by default).

Not modelled: DDP's own gradient buckets (NO_SHARD here means FSDP NO_SHARD), the attention mask
(B x S x S bytes, shared by all layers), the speech tokenizer (not used in training), eval steps.

The package, one job per module: `presets` (released-size configs, `resolve_config`), `shapes` (the
meta-device model and its units), `activations` (the activation model), `settings` (`PlanSettings`:
the run a plan is for), `plan` (`plan_memory`, `MemoryPlan`: the phases), `advice` (what makes a
plan fit), `config` (`plan_from_config`: a `fit` config read by the real CLI).
"""

from tts_lightning.distributed.memory.activations import (
    HEAD_LOGIT_BYTES,
    LOGIT_BYTES,
    PREDICTOR_LAYER_BYTES,
    PREDICTOR_TARGET_BYTES,
    TALKER_LAYER_BYTES,
    _activation_bytes,
    _checkpointed,
    _layer_bytes,
)
from tts_lightning.distributed.memory.config import parse_fit_config, plan_from_config
from tts_lightning.distributed.memory.plan import (
    CUDA_OVERHEAD_BYTES,
    GiB,
    MemoryPlan,
    asr_model_bytes,
    plan_memory,
    speech_tokenizer_bytes,
)
from tts_lightning.distributed.memory.presets import PRESETS, resolve_config
from tts_lightning.distributed.memory.settings import PRECISIONS, SHARDINGS, PlanSettings
from tts_lightning.distributed.memory.shapes import (
    FSDP2_GROUPS,
    FSDP2_LAYERS,
    LAYOUTS,
    PREDICTOR_LAYER,
    TALKER_LAYER,
    TEXT_EMBEDDING,
    ModelShape,
    Unit,
    build_meta_model,
    count_parameters,
    model_shape,
)
from tts_lightning.model.parameters import DEFAULT_FREEZE, matches

__all__ = [
    "CUDA_OVERHEAD_BYTES",
    "DEFAULT_FREEZE",
    "FSDP2_GROUPS",
    "FSDP2_LAYERS",
    "LAYOUTS",
    "HEAD_LOGIT_BYTES",
    "LOGIT_BYTES",
    "PRECISIONS",
    "PREDICTOR_LAYER",
    "PREDICTOR_LAYER_BYTES",
    "PREDICTOR_TARGET_BYTES",
    "PRESETS",
    "SHARDINGS",
    "TALKER_LAYER",
    "TALKER_LAYER_BYTES",
    "TEXT_EMBEDDING",
    "GiB",
    "MemoryPlan",
    "ModelShape",
    "PlanSettings",
    "Unit",
    "_activation_bytes",
    "_checkpointed",
    "_layer_bytes",
    "build_meta_model",
    "count_parameters",
    "matches",
    "model_shape",
    "parse_fit_config",
    "plan_from_config",
    "plan_memory",
    "resolve_config",
    "asr_model_bytes",
    "speech_tokenizer_bytes",
]
