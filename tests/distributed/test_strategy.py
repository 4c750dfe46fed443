"""`Qwen3TTSFSDPStrategy` without spawning: its defaults, its mixed-precision config, its YAML surface,
and one in-process FSDP wrap of the tiny model on CPU (a 1-rank gloo group)."""

import socket

import pytest
import torch
from jsonargparse import ArgumentError, ArgumentParser
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy, Strategy
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, ShardingStrategy

from tts_lightning.distributed.fsdp import DEFAULT_CHECKPOINT, DEFAULT_WRAP, Qwen3TTSFSDPStrategy
from tts_lightning.distributed.row_chunks import is_checkpointed_by_rows
from tts_lightning.model.row_blocks import DEFAULT_TEXT_EMBEDDING_BLOCKS

TALKER_LAYER = "qwen_tts.core.models.modeling_qwen3_tts.Qwen3TTSTalkerDecoderLayer"
PREDICTOR_LAYER = "qwen_tts.core.models.modeling_qwen3_tts.Qwen3TTSDecoderLayer"


def _layer_classes():
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSDecoderLayer, Qwen3TTSTalkerDecoderLayer

    return Qwen3TTSTalkerDecoderLayer, Qwen3TTSDecoderLayer


def _speaker_encoder_class():
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSSpeakerEncoder

    return Qwen3TTSSpeakerEncoder


def _policy_classes(policy) -> set[type]:
    return set(policy._module_classes)  # torch's ModuleWrapPolicy keeps its classes here


# -- defaults -------------------------------------------------------------------------------------
def test_defaults_wrap_and_checkpoint_both_decoder_layer_classes():
    talker_layer, predictor_layer = _layer_classes()
    assert {TALKER_LAYER, PREDICTOR_LAYER} <= set(DEFAULT_WRAP)
    assert {TALKER_LAYER, PREDICTOR_LAYER} == set(DEFAULT_CHECKPOINT)
    strategy = Qwen3TTSFSDPStrategy()
    wrapped = _policy_classes(strategy.kwargs["auto_wrap_policy"])
    assert wrapped == {talker_layer, predictor_layer, nn.Embedding, _speaker_encoder_class()}
    checkpointed = strategy._activation_checkpointing_kwargs["auto_wrap_policy"]
    assert _policy_classes(checkpointed) == {talker_layer, predictor_layer}
    assert strategy.sharding_strategy == ShardingStrategy.FULL_SHARD
    assert strategy._state_dict_type == "sharded"


def test_empty_checkpointing_policy_turns_checkpointing_off():
    assert Qwen3TTSFSDPStrategy(activation_checkpointing_policy=[])._activation_checkpointing_kwargs == {}


def test_bad_wrap_class_is_named():
    with pytest.raises(ValueError, match="no_such_module.Layer"):
        Qwen3TTSFSDPStrategy(auto_wrap_policy=["no_such_module.Layer"])
    with pytest.raises(ValueError, match="not a torch.nn.Module"):
        Qwen3TTSFSDPStrategy(auto_wrap_policy=["collections.OrderedDict"])


# -- mixed precision --------------------------------------------------------------------------------
def test_bf16_mixed_keeps_buffers_and_reduction_fp32():
    config = Qwen3TTSFSDPStrategy(precision_plugin=FSDPPrecision("bf16-mixed")).mixed_precision_config
    assert config.param_dtype == torch.bfloat16
    assert config.reduce_dtype == torch.float32
    assert config.buffer_dtype == torch.float32
    assert not config.cast_root_forward_inputs  # the batch's fp32 speaker embeddings stay fp32
    # What it guards against: Lightning's own config casts buffers (the MRoPE inv_freq) to bf16.
    lightning = FSDPStrategy(precision_plugin=FSDPPrecision("bf16-mixed")).mixed_precision_config
    assert lightning.buffer_dtype == torch.bfloat16
    opted_out = Qwen3TTSFSDPStrategy(precision_plugin=FSDPPrecision("bf16-mixed"), mixed_precision_buffers_fp32=False)
    assert opted_out.mixed_precision_config.buffer_dtype == torch.bfloat16


def test_explicit_mixed_precision_is_kept():
    from torch.distributed.fsdp import MixedPrecision

    mine = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    strategy = Qwen3TTSFSDPStrategy(precision_plugin=FSDPPrecision("bf16-mixed"), mixed_precision=mine)
    assert strategy.mixed_precision_config is mine


# -- YAML ---------------------------------------------------------------------------------------
def _trainer_parser() -> LightningArgumentParser:
    """The Trainer arguments exactly as LightningCLI adds them (`trainer.strategy` typed by Trainer)."""
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(Trainer, "trainer")
    return parser


def _strategy_from_yaml(text: str) -> Strategy:
    parser = _trainer_parser()
    return parser.instantiate(parser.parse_string(text)).trainer.strategy


def test_typed_fsdp_options_are_accepted_from_yaml():
    strategy = _strategy_from_yaml("""
trainer:
  strategy:
    class_path: tts_lightning.distributed.fsdp.Qwen3TTSFSDPStrategy
    init_args:
      sharding_strategy: SHARD_GRAD_OP
      state_dict_type: full
      cpu_offload: true
      use_orig_params: false
      limit_all_gathers: false
      forward_prefetch: true
      backward_prefetch: BACKWARD_POST
      sync_module_states: true
      activation_checkpointing_policy: []
      auto_wrap_policy: [qwen_tts.core.models.modeling_qwen3_tts.Qwen3TTSTalkerDecoderLayer]
""")
    assert isinstance(strategy, Qwen3TTSFSDPStrategy)
    # Every value differs from the default, so each one shows it arrived.
    assert strategy.sharding_strategy == ShardingStrategy.SHARD_GRAD_OP
    assert strategy._state_dict_type == "full"
    assert strategy.cpu_offload == CPUOffload(offload_params=True)
    assert strategy.kwargs["use_orig_params"] is False
    assert strategy.kwargs["limit_all_gathers"] is False
    assert strategy.kwargs["forward_prefetch"] is True
    assert strategy.kwargs["backward_prefetch"] == BackwardPrefetch.BACKWARD_POST
    assert strategy.kwargs["sync_module_states"] is True
    assert strategy._activation_checkpointing_kwargs == {}
    assert _policy_classes(strategy.kwargs["auto_wrap_policy"]) == {_layer_classes()[0]}


@pytest.mark.parametrize(
    "init_args, needle",
    [
        # The words that name the option's own problem: the error also echoes every given value.
        ("backward_prefetch: SOMETIMES", r'Parser key "backward_prefetch":\s+Does not validate'),
        ("sharding_strategy: SHARD_EVERYTHING", r'Parser key "sharding_strategy":\s+Expected a typing.Literal'),
        ("limit_all_gathers: maybe", r"Parser key \"limit_all_gathers\":\s+Expected a <class 'bool'>"),
        ("no_such_fsdp_option: 1", "Option 'no_such_fsdp_option' is not accepted"),
    ],
)
def test_bad_fsdp_options_are_rejected_by_name(init_args, needle):
    parser = _trainer_parser()
    text = (
        "trainer:\n  strategy:\n    class_path: tts_lightning.distributed.fsdp.Qwen3TTSFSDPStrategy\n"
        f"    init_args:\n      {init_args}\n"
    )
    with pytest.raises(ArgumentError, match=needle):
        parser.parse_string(text)


def test_plain_lightning_fsdp_strategy_still_parses():
    """Configs written for Lightning's own FSDPStrategy keep working (on GPU machines): its typed
    arguments, with wrap / checkpointing policies as lists of class import paths."""
    strategy = _strategy_from_yaml(f"""
trainer:
  accelerator: gpu
  devices: 4
  precision: bf16-mixed
  strategy:
    class_path: lightning.pytorch.strategies.FSDPStrategy
    init_args:
      sharding_strategy: FULL_SHARD
      state_dict_type: sharded
      cpu_offload: false
      auto_wrap_policy: [{TALKER_LAYER}, {PREDICTOR_LAYER}, torch.nn.Embedding]
      activation_checkpointing_policy: [{TALKER_LAYER}, {PREDICTOR_LAYER}]
""")
    assert type(strategy) is FSDPStrategy
    assert _policy_classes(strategy.kwargs["auto_wrap_policy"]) == {*_layer_classes(), nn.Embedding}
    assert _policy_classes(strategy._activation_checkpointing_kwargs["auto_wrap_policy"]) == set(_layer_classes())
    assert strategy._state_dict_type == "sharded"


def test_plain_fsdp_strategy_rejects_untyped_options():
    """Why the subclass types them: Lightning's FSDPStrategy takes them only through **kwargs,
    which LightningCLI does not accept from YAML."""
    parser = _trainer_parser()
    with pytest.raises(ArgumentError, match="Option 'limit_all_gathers' is not accepted"):
        parser.parse_string(
            "trainer:\n  strategy:\n    class_path: lightning.pytorch.strategies.FSDPStrategy\n"
            "    init_args:\n      limit_all_gathers: true\n"
        )


def test_strategy_argument_accepts_a_strategy_name_too():
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--strategy", type=str | Strategy)
    assert parser.parse_args(["--strategy", "auto"]).strategy == "auto"


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_the_trainers_precision_becomes_the_clipping_plugin(precision):
    """`Trainer(precision=...)` hands the strategy Lightning's FSDPPrecision (whose norm clipping
    raises); the strategy keeps its settings (scaler included) in the plugin that clips through the
    FSDP root (clipping by the global norm with 2 ranks: tests/distributed/test_real_size_paths.py)."""
    import lightning as L

    from tts_lightning.distributed.fsdp import Qwen3TTSFSDPPrecision

    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=Qwen3TTSFSDPStrategy(), precision=precision, logger=False
    )
    plugin = trainer.precision_plugin
    assert type(plugin) is Qwen3TTSFSDPPrecision and plugin.precision == precision
    assert (plugin.scaler is not None) == (precision == "16-mixed")
    with pytest.raises(RuntimeError, match="needs the FSDP root"):  # nothing wrapped yet
        plugin.clip_grad_by_norm(torch.optim.SGD([nn.Parameter(torch.zeros(1))]), 1.0)


# -- one rank of real FSDP on CPU ---------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def process_group():
    """One gloo rank for one test (cheap): no group is shared between tests."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "a process group leaked into this test"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def batch(tiny_dir):
    from tts_lightning.model.pretrained import check_pretrained, load_text_tokenizer
    from tts_lightning.model.sequence import SpecialIds, build_sequence, collate, tokenize_text

    info = check_pretrained(tiny_dir)
    tokenizer, ids = load_text_tokenizer(info), SpecialIds.from_config(info.config)
    g = torch.Generator().manual_seed(0)
    codebook = info.config["talker_config"]["code_predictor_config"]["vocab_size"]
    sequences = [
        build_sequence(
            ids,
            tokenize_text(tokenizer, text),
            torch.randint(0, codebook, (frames, 16), generator=g),
            language="english",
        )
        for text, frames in (("The morning train was late again.", 40), ("She planted roses.", 25))
    ]
    speakers = torch.randn(2, info.config["talker_config"]["hidden_size"], generator=g)
    return collate(sequences, speakers, [0, 1], pad_text_id=ids.tts_pad)


def _wrapped(tiny_dir, precision: str, adapter=None, **strategy_kwargs):
    from tts_lightning import Qwen3TTSModule

    module = Qwen3TTSModule(str(tiny_dir), speakers=["alice", "bob"], adapter=adapter)
    module.configure_model()
    # NO_SHARD: what FSDP switches to at world size 1 anyway (said here, so it does not warn).
    strategy = Qwen3TTSFSDPStrategy(
        parallel_devices=[torch.device("cpu")],
        sharding_strategy="NO_SHARD",
        precision_plugin=FSDPPrecision(precision),
        **strategy_kwargs,
    )
    return module, strategy._setup_model(module)  # what Lightning calls when fit starts


def _unwrap(module: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) else module


def _rotary_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b for n, b in module.named_buffers() if n.endswith("rotary_emb.inv_freq")}


def test_one_rank_wrap_units_checkpointing_and_bf16(process_group, tiny_dir, batch):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FullyShardedDataParallel

    talker_layer, predictor_layer = _layer_classes()
    module32, wrapped32 = _wrapped(tiny_dir, "32-true")
    module_bf, wrapped_bf = _wrapped(tiny_dir, "bf16-mixed")

    # Every decoder layer of both kinds and every embedding is its own FSDP unit.
    wanted = [m for m in module_bf.modules() if isinstance(m, (talker_layer, predictor_layer, nn.Embedding))]
    units = {id(_unwrap(m.module)) for m in wrapped_bf.modules() if isinstance(m, FullyShardedDataParallel)}
    # tiny: 2 talker layers, 2 predictor layers; embeddings: the text embedding's row blocks, the
    # talker's codec embedding and the predictor's 15
    assert len(wanted) == 2 + 2 + DEFAULT_TEXT_EMBEDDING_BLOCKS + 1 + 15
    missing = [type(m).__name__ for m in wanted if id(m) not in units]
    assert not missing, f"not FSDP units: {missing}"
    # ... and both layer kinds, only they, are activation-checkpointed.
    checkpointed = [_unwrap(m) for m in wrapped_bf.modules() if isinstance(m, CheckpointWrapper)]
    assert sorted(type(m).__name__ for m in checkpointed) == sorted(
        [talker_layer.__name__] * 2 + [predictor_layer.__name__] * 2
    )
    # The predictor's wrappers recompute by blocks of frames (tts_lightning.distributed.row_chunks).
    by_rows = [_unwrap(m) for m in wrapped_bf.modules() if is_checkpointed_by_rows(m)]
    assert [type(m).__name__ for m in by_rows] == [predictor_layer.__name__] * 2

    computed = []
    hook = module_bf.talker.model.layers[0].register_forward_hook(
        lambda m, i, o: computed.append((o[0] if isinstance(o, tuple) else o).dtype)
    )
    with torch.no_grad():
        out32, out_bf = wrapped32(batch), wrapped_bf(batch)
    hook.remove()
    assert computed == [torch.bfloat16]  # the bf16 path really computes in bf16 (no CPU autocast)
    rotary = _rotary_buffers(wrapped_bf)
    assert len(rotary) == 2 and all(b.dtype == torch.float32 for b in rotary.values()), rotary
    # bf16 rounding moves the loss a little, not more (tiny model: losses ~7.5 and ~6 nats).
    torch.testing.assert_close(out_bf.talker_loss, out32.talker_loss, rtol=1e-2, atol=0)
    torch.testing.assert_close(out_bf.code_predictor_loss, out32.code_predictor_loss, rtol=1e-2, atol=0)


def _one_block_then_blocks_of_16(monkeypatch, model, batch, seen: list[list[int]], full=lambda grad: grad.clone()):
    """(loss, gradients, each frame's NLL, top-1 codes) of a step of ``model`` with the code
    predictor's layers and heads in one block, then in blocks of 16 rows; ``seen`` (row counts the
    hooks record) emptied before each."""
    from tts_lightning.distributed import row_chunks

    results = []
    for rows in (10**6, 16):
        monkeypatch.setattr(row_chunks, "PREDICTOR_ROWS", rows)
        monkeypatch.setattr(row_chunks, "HEAD_ROWS", rows)
        model.zero_grad(set_to_none=True)
        for record in seen:
            record.clear()
        out = model(batch)
        out.loss.backward()
        grads = [full(p.grad) for p in model.parameters() if p.grad is not None]
        results.append((out.loss.detach(), grads, out.predictor_nll.detach(), out.predictor_predictions))
    return results


def _assert_blocks_change_nothing(results) -> None:
    (loss_one, grads_one, nll_one, codes_one), (loss_blocks, grads_blocks, nll_blocks, codes_blocks) = results
    torch.testing.assert_close(loss_blocks, loss_one, rtol=1e-6, atol=0)
    # Each frame's NLL and top-1 codes, in the frames' order (the mean would hide a reordering).
    torch.testing.assert_close(nll_blocks, nll_one, rtol=1e-5, atol=1e-6)
    assert torch.equal(codes_blocks, codes_one)
    assert len(grads_blocks) == len(grads_one) > 0
    for a, b in zip(grads_blocks, grads_one):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# forward, then each block recomputed in backward, the last first
BLOCKS_OF_16 = [16, 16, 16, 16, 1] + [1, 16, 16, 16, 16]


@pytest.mark.parametrize("adapter", [None, {"rank": 4}])
def test_one_rank_predictor_blocks_of_rows_keep_loss_and_gradients(
    process_group, tiny_dir, batch, monkeypatch, adapter
):
    """Through the real FSDP1 wrap: the batch's 65 frames recomputed in blocks of 16 rows (and one
    of 1) give the loss and gradients of one block, in the predictor's layers and in its heads (the
    root unit's); with LoRA too, whose adapters are FSDP units of their own inside the layer (called
    once per block)."""
    module, wrapped = _wrapped(tiny_dir, "32-true", adapter=adapter)
    layer = next(_unwrap(m) for m in wrapped.modules() if is_checkpointed_by_rows(m))
    rows_seen: list[int] = []
    layer.register_forward_pre_hook(lambda m, args: rows_seen.append(args[0].shape[0]))
    head_rows: list[int] = []
    module.talker.code_predictor.lm_head[0].register_forward_pre_hook(lambda m, args: head_rows.append(len(args[0])))
    results = _one_block_then_blocks_of_16(monkeypatch, wrapped, batch, [rows_seen, head_rows])
    assert rows_seen == head_rows == BLOCKS_OF_16
    _assert_blocks_change_nothing(results)


def test_one_rank_fsdp2_head_blocks_keep_loss_and_gradients(process_group, tiny_dir, batch, monkeypatch):
    """Through the real FSDP2 layout (one gloo rank): the heads, root-unit parameters that FSDP2
    frees after the forward, are gathered again before the backward recomputes their blocks of 16
    frames; the loss, each frame's NLL and top-1 codes and every gradient are those of one block."""
    from torch.distributed.device_mesh import init_device_mesh

    from tts_lightning import Qwen3TTSModule
    from tts_lightning.distributed.fsdp import import_classes
    from tts_lightning.distributed.fsdp2 import DEFAULT_GROUPS, DEFAULT_LAYERS, apply_fully_shard

    module = Qwen3TTSModule(str(tiny_dir), speakers=["alice", "bob"])
    module.configure_model()
    apply_fully_shard(
        module,
        module.model,
        layer_classes=tuple(import_classes(list(DEFAULT_LAYERS))),
        groups=DEFAULT_GROUPS,
        checkpoint_classes=tuple(import_classes(list(DEFAULT_CHECKPOINT))),
        mesh=init_device_mesh("cpu", (1,)),
        reshard_after_forward=True,  # the strategy's default, passed to the root too
    )
    head_rows: list[int] = []
    module.talker.code_predictor.lm_head[0].register_forward_pre_hook(lambda m, args: head_rows.append(len(args[0])))
    results = _one_block_then_blocks_of_16(monkeypatch, module, batch, [head_rows], full=lambda g: g.full_tensor())
    assert head_rows == BLOCKS_OF_16
    _assert_blocks_change_nothing(results)


def test_lightning_default_mixed_precision_would_cast_the_rotary_buffer(process_group, tiny_dir, batch):
    """The trap the fp32-buffer default avoids, shown on the same wrap: without it inv_freq is bf16."""
    _, wrapped = _wrapped(tiny_dir, "bf16-mixed", mixed_precision_buffers_fp32=False)
    with torch.no_grad():
        wrapped(batch)
    rotary = _rotary_buffers(wrapped)
    assert rotary and all(b.dtype == torch.bfloat16 for b in rotary.values())
