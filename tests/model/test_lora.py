"""LoRA adapters (peft) on Qwen3TTSModule, one process: parity at zero init, only adapters (and the
chosen extras) get gradients and move, adapter-only checkpoints that resume, merged weights."""

import pytest
import torch

from tts_lightning import Qwen3TTSModule
from tts_lightning.data.audio import load_audio
from tts_lightning.data.demo import demo_dir
from tts_lightning.model.lora import LoRASettings, MergedWeights, is_adapter_key
from tts_lightning.model.pretrained import check_pretrained, load_speech_tokenizer, load_text_tokenizer
from tts_lightning.model.sequence import SpecialIds, build_sequence, collate, tokenize_text

ADAPTER = dict(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def batch(tiny_dir):
    info = check_pretrained(tiny_dir)
    tokenizer, speech = load_text_tokenizer(info), load_speech_tokenizer(info)
    ids = SpecialIds.from_config(info.config)
    sequences = []
    for clip, frames in (("alice/alice_001", 8), ("bob/bob_002", 20)):
        path = demo_dir() / "clips" / clip
        codes = speech.encode(load_audio(path.with_suffix(".flac")).numpy(), sr=24_000).audio_codes[0][:frames]
        text_ids = tokenize_text(tokenizer, path.with_suffix(".txt").read_text().strip())
        sequences.append(build_sequence(ids, text_ids, codes, language="auto"))
    speakers = torch.randn(2, info.config["talker_config"]["hidden_size"], generator=torch.Generator().manual_seed(1))
    return collate(sequences, speakers, [0, 1], pad_text_id=ids.tts_pad)


def _module(tiny_dir, **kwargs):
    module = Qwen3TTSModule(str(tiny_dir), speakers=["alice", "bob"], **kwargs)
    module.configure_model()
    return module


def test_zero_init_parity_and_deterministic_adapters(tiny_dir, batch):
    base = _module(tiny_dir).eval()
    lora = _module(tiny_dir, adapter=ADAPTER).eval()
    again = _module(tiny_dir, adapter=LoRASettings(**ADAPTER)).eval()
    with torch.no_grad():
        torch.testing.assert_close(lora(batch).loss, base(batch).loss, atol=0, rtol=0)
    adapters = {n: p for n, p in lora.model.named_parameters() if is_adapter_key(n)}
    assert adapters and all(not p.is_meta for p in lora.model.parameters())
    for name, value in adapters.items():  # lora_A drawn (same every time), lora_B zero
        torch.testing.assert_close(value, again.model.get_parameter(name), atol=0, rtol=0)
        assert (value.abs().sum() > 0) == (".lora_A." in name), name
    # The base weights are the pretrained ones, at peft's new names.
    name = "talker.model.layers.0.self_attn.q_proj"
    torch.testing.assert_close(
        lora.model.get_parameter(f"{name}.base_layer.weight"),
        base.model.get_parameter(f"{name}.weight"),
        atol=0,
        rtol=0,
    )
    assert lora.hparams.adapter == LoRASettings(**ADAPTER).to_dict()  # plain data in checkpoints


def test_only_adapters_and_extras_train(tiny_dir, batch):
    module = _module(tiny_dir, adapter={**ADAPTER, "trainable": ["talker.codec_head"]}, learning_rate=1e-2)
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in trainable if is_adapter_key(n)} | {"talker.codec_head.weight"}
    assert any(".code_predictor.model.layers." in n for n in trainable)
    assert any(".mlp.down_proj.lora_B." in n for n in trainable)
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = module(batch).loss
        loss.backward()
        for n, p in module.model.named_parameters():
            assert (p.grad is not None) == (n in trainable), n
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    for n, p in module.model.named_parameters():
        assert torch.equal(p, before[n]) != (n in trainable), n  # frozen ones fixed, trained ones moved


def test_merged_weights_equal_adapter_model(tiny_dir, batch):
    from tts_lightning.model.loading import copy_model

    module = _module(tiny_dir, adapter=ADAPTER)
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    merged = MergedWeights(module.model)
    assert "talker.model.layers.0.self_attn.q_proj.weight" in merged
    assert not any(is_adapter_key(k) or ".base_layer." in k for k in merged)
    plain = copy_model(module.model, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        adapted = module.eval()(batch).loss
        from tts_lightning.model.loss import compute_loss

        merged_loss = compute_loss(plain.talker, batch, module.hparams.sub_talker_loss_weight).loss
    assert abs(float(adapted) - float(merged_loss)) < 1e-5
    assert abs(float(adapted) - float(_module(tiny_dir).eval()(batch).loss)) > 1e-3  # adapters matter


def test_bad_settings_are_refused(tiny_dir):
    with pytest.raises(ValueError, match="rank"):
        LoRASettings(rank=0)
    with pytest.raises(ValueError, match="match no nn.Linear"):
        _module(tiny_dir, adapter={"target_modules": ["no.such.layer"]})
    with pytest.raises(ValueError, match="match no parameter"):
        _module(tiny_dir, adapter={"trainable": ["talker.no_such_head"]})


def test_frozen_base_dtype_follows_the_precision():
    assert LoRASettings().frozen_dtype("bf16-mixed") == torch.bfloat16
    assert LoRASettings().frozen_dtype("32-true") == torch.float32
    assert LoRASettings(base_dtype="fp32").frozen_dtype("bf16-mixed") == torch.float32
    with pytest.raises(ValueError, match="bf16"):
        LoRASettings(base_dtype="bf16").frozen_dtype("32-true")


def test_cast_frozen_gives_the_meta_base_its_storage_dtype(tiny_dir):
    """FSDP2 shards the meta model before any weight exists, and its shards keep the dtype they were
    sharded with: `MetaWeights.cast_frozen` re-registers the frozen meta parameters in the frozen
    dtype first (the adapters stay fp32), and the weights then read into them are the pretrained ones."""
    from tts_lightning.model.loading import MetaWeights, WeightReader, build_empty_model
    from tts_lightning.model.lora import checkpoint_key, inject_lora

    info = check_pretrained(tiny_dir)
    model = inject_lora(build_empty_model(info), LoRASettings(**ADAPTER))
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_key(name))
    weights = MetaWeights(model, info, frozen_dtype=torch.bfloat16)
    frozen = sum(not p.requires_grad for p in model.parameters())
    assert weights.cast_frozen(model) == frozen > 0
    assert weights.cast_frozen(model) == 0  # already in the frozen dtype
    assert all(p.is_meta for p in model.parameters())
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    weights.materialize_all(model)
    reader = WeightReader(info)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            assert torch.equal(param, reader.read(checkpoint_key(name)).to(torch.bfloat16)), name


@pytest.fixture(scope="module")
def extras_checkpoint(tiny_dir, batch, tmp_path_factory):
    """A LoRA run with ``talker.codec_head`` trained in full besides the adapters: 3 Lightning steps
    in one process, saved by the trainer (adapters, the head, the speaker table, optimizer state)."""
    import lightning as L
    from torch.utils.data import DataLoader

    module = _module(tiny_dir, adapter={**ADAPTER, "trainable": ["talker.codec_head"]}, learning_rate=1e-2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=DataLoader([batch] * 3, batch_size=None))
    path = tmp_path_factory.mktemp("lora-extras") / "extras.ckpt"
    trainer.save_checkpoint(path)
    return path, module.eval()


def test_load_from_checkpoint_restores_adapters_and_extras(extras_checkpoint, tiny_dir, batch):
    """`Qwen3TTSModule.load_from_checkpoint` of a (full-format) LoRA checkpoint, which holds only the
    trainable tensors: the base comes from the pretrained directory, the rest from the checkpoint."""
    from tts_lightning.model.checkpoint import load_training_checkpoint

    path, trained = extras_checkpoint
    stored = load_training_checkpoint(path).state_dict
    assert "model.talker.codec_head.weight" in stored
    assert not any(".base_layer." in k for k in stored)  # the frozen base is not in it
    loaded = Qwen3TTSModule.load_from_checkpoint(path).eval()
    assert loaded.adapter == trained.adapter and loaded.trainable_keys == trained.trainable_keys
    expected = trained.state_dict()
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, expected[key], atol=0, rtol=0, msg=key)
    base = _module(tiny_dir).model
    assert not torch.equal(loaded.model.talker.codec_head.weight, base.talker.codec_head.weight)
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch).loss, trained(batch).loss, atol=0, rtol=0)


def test_adapter_only_export_with_extras_loads_in_peft(extras_checkpoint, tiny_dir, batch, tmp_path):
    """`export --adapter-only` of a run that trained ``talker.codec_head`` in full: peft loads it onto
    the base model built from the pretrained directory (the head as ``modules_to_save``) and gives
    the logits of the merged export and of the training module."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from tts_lightning.model.export import export_adapter, export_custom_voice
    from tts_lightning.model.loading import MetaWeights, build_empty_model
    from tts_lightning.model.loss import compute_loss

    path, trained = extras_checkpoint
    adapter = export_adapter(path, tmp_path / "adapter")
    voice = export_custom_voice(path, tmp_path / "voice", dtype="fp32")
    info = check_pretrained(tiny_dir)
    base = MetaWeights(m := build_empty_model(info), info).materialize_all(m)
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    assert peft_model.peft_config["default"].modules_to_save == ["talker.codec_head"]
    merged = MetaWeights(m := build_empty_model(info), info).materialize_all(m).eval()
    merged.load_state_dict(load_file(str(voice / "model.safetensors")), strict=False)  # no speaker encoder
    weight = trained.hparams.sub_talker_loss_weight
    with torch.no_grad():
        ours = compute_loss(peft_model.base_model.model.talker, batch, weight)
        theirs = compute_loss(merged.talker, batch, weight)
        training = trained(batch)
        plain = compute_loss(_module(tiny_dir).eval().talker, batch, weight)
    for out in (theirs, training):
        torch.testing.assert_close(ours.talker_logits, out.talker_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.predictor_nll, out.predictor_nll, atol=1e-5, rtol=1e-5)
        assert torch.equal(ours.predictor_predictions, out.predictor_predictions)
    assert (ours.talker_logits - plain.talker_logits).abs().max() > 1e-3  # adapters and head trained


@pytest.mark.parametrize("adapter", [None, ADAPTER], ids=["plain", "lora"])
def test_copy_model_frees_the_gathered_state_as_it_copies(tiny_dir, adapter):
    """`copy_model(state=...)` (the samples callback's copy from a gathered full state) removes each
    value from the state once copied and keeps no reference to it: on a CPU run, where the gathered
    fp32 state and an fp32 copy both live in host memory, they hold about one model together, not
    two: the copy holds at most one of its parameters above where it started (torch's `MemTracker`
    counts every tensor; at this size the text embedding's join, which `test_a_blocked_embedding_
    is_copied_block_by_block_never_joined` checks, is smaller than the largest parameter). The copy
    equals the one made from the parameters (LoRA merged)."""
    import weakref

    from torch.distributed._tools.mem_tracker import MemTracker

    from tts_lightning.model.loading import copy_model

    module = _module(tiny_dir, adapter=adapter)
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    reference = copy_model(module.model, dtype=torch.float32, device="cpu")

    refs: dict[str, weakref.ref] = {}
    alive_when_popped: list[int] = []  # values popped before this pop that are still referenced

    class Gathered(dict):
        def pop(self, key, *default):
            alive_when_popped.append(sum(refs[n]() is not None for n in refs if n not in self))
            return super().pop(key, *default)

    state = Gathered({name: p.detach().clone() for name, p in module.model.named_parameters()})
    refs.update({name: weakref.ref(value) for name, value in state.items()})
    tracker = MemTracker()
    tracker.track_external(*state.values())
    with tracker:
        start = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        copy = copy_model(module.model, dtype=torch.float32, device="cpu", state=state)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    largest = max(p.numel() * p.element_size() for p in copy.parameters())  # the official shapes
    assert peak - start <= largest + 1024, (peak - start, largest)  # a few scalars beside it
    assert len(state) == 0 and all(r() is None for r in refs.values())  # nothing kept, nothing aliased
    assert len(alive_when_popped) == len(refs)
    assert max(alive_when_popped) == 0, alive_when_popped  # each value freed as soon as it is popped
    copied, expected = dict(copy.named_parameters()), dict(reference.named_parameters())
    assert copied.keys() == expected.keys()
    assert all(torch.equal(copied[k], expected[k]) for k in expected)


def test_a_blocked_embedding_is_copied_block_by_block_never_joined(tiny_dir):
    """`MergedWeights.copy_into` writes the text embedding's row blocks straight into the copy's rows:
    no joined weight is made beside the copy (at the released sizes that join was 1.2 GB of host
    memory on rank 0 while the samples callback built its copy), and each block is released once
    copied."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from tts_lightning.model.row_blocks import TEXT_EMBEDDING

    module = _module(tiny_dir)
    state = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    key = f"{TEXT_EMBEDDING}.weight"
    blocks = [n for n in state if n.startswith(f"{TEXT_EMBEDDING}.blocks.")]
    assert len(blocks) > 1
    joined = torch.cat([state[n] for n in blocks])  # the official weight, for comparison
    source = MergedWeights(module.model, state)
    out = torch.empty_like(joined)
    tracker = MemTracker()
    tracker.track_external(*state.values(), out)
    with tracker:
        start = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        source.copy_into(key, out, release=True)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert peak == start  # nothing allocated: no join
    assert torch.equal(out, joined)
    assert not any(n in state for n in blocks) and key not in source
    bf16 = torch.empty(joined.shape, dtype=torch.bfloat16)
    MergedWeights(module.model).copy_into(key, bf16)  # any dtype: cast while copied
    assert torch.equal(bf16, joined.to(torch.bfloat16))
