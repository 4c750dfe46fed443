"""Qwen3TTSModule: gradients reach what generation uses, frozen parts stay fixed, it can learn."""

import pytest
import torch

from tts_lightning import Qwen3TTSModule
from tts_lightning.data.audio import load_audio
from tts_lightning.data.demo import demo_dir
from tts_lightning.model.pretrained import check_pretrained, load_speech_tokenizer, load_text_tokenizer
from tts_lightning.model.sequence import SpecialIds, build_sequence, collate, tokenize_text


@pytest.fixture(scope="module")
def examples(tiny_dir):
    info = check_pretrained(tiny_dir)
    tokenizer, speech = load_text_tokenizer(info), load_speech_tokenizer(info)
    ids = SpecialIds.from_config(info.config)
    out = []
    for clip, frames in (("alice/alice_001", 8), ("bob/bob_002", 20)):
        path = demo_dir() / "clips" / clip
        codes = speech.encode(load_audio(path.with_suffix(".flac")).numpy(), sr=24_000).audio_codes[0][:frames]
        text_ids = tokenize_text(tokenizer, path.with_suffix(".txt").read_text().strip())
        out.append(build_sequence(ids, text_ids, codes, language="auto"))
    speakers = torch.randn(2, info.config["talker_config"]["hidden_size"], generator=torch.Generator().manual_seed(1))
    return out, speakers, ids


def _module(tiny_dir, **kwargs):
    module = Qwen3TTSModule(str(tiny_dir), speakers=["alice", "bob"], **kwargs)
    module.configure_model()
    return module


def test_every_head_gets_gradient_and_frozen_parts_none(tiny_dir, examples):
    sequences, speakers, ids = examples
    module = _module(tiny_dir, freeze=["speaker_encoder", "talker.model.text_embedding"])
    batch = collate(sequences, speakers, [0, 1], pad_text_id=ids.tts_pad)
    module(batch).loss.backward()
    for j, head in enumerate(module.talker.code_predictor.lm_head):
        assert head.weight.grad is not None and head.weight.grad.abs().sum() > 0, f"head {j}"
    # Embeddings 0-13 feed the predictor; all 15 (codebooks 1-15) feed the talker's next input.
    assert len(module.talker.code_predictor.model.codec_embedding) == 15
    for j, emb in enumerate(module.talker.code_predictor.model.codec_embedding):
        assert emb.weight.grad.abs().sum() > 0, f"predictor embedding {j}"
    for name in (
        "talker.text_projection.linear_fc1.weight",
        "talker.codec_head.weight",
        "talker.model.codec_embedding.weight",
        "talker.model.layers.0.self_attn.q_proj.weight",
    ):
        assert module.model.get_parameter(name).grad.abs().sum() > 0, name
    frozen = [
        (n, p)
        for n, p in module.model.named_parameters()
        if n.startswith(("speaker_encoder", "talker.model.text_embedding"))
    ]
    assert frozen and all(not p.requires_grad and p.grad is None for _, p in frozen)
    assert all(p.dtype == torch.float32 for p in module.model.parameters())


def test_loss_invariant_to_padding(tiny_dir, examples):
    sequences, speakers, ids = examples
    module = _module(tiny_dir).eval()
    with torch.no_grad():
        alone = module(collate(sequences[:1], speakers[:1], [0], pad_text_id=ids.tts_pad))
        padded = module(collate(sequences, speakers, [0, 1], pad_text_id=ids.tts_pad))
    assert sequences[1].text_ids.shape[0] > sequences[0].text_ids.shape[0]  # the first one is padded
    torch.testing.assert_close(padded.talker_nll[padded.talker_example == 0], alone.talker_nll, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        padded.predictor_nll[padded.predictor_example == 0], alone.predictor_nll, atol=1e-5, rtol=0
    )


def test_memorises_one_clip(tiny_dir, examples):
    sequences, speakers, ids = examples
    torch.manual_seed(0)
    module = _module(tiny_dir)
    batch = collate(sequences[:1], speakers[:1], [0], pad_text_id=ids.tts_pad)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
    first = None
    for _ in range(40):
        loss = module(batch).loss
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    final = module(batch).loss.item()
    assert final < first / 10, (first, final)


def test_predict_batch_is_typed(tiny_dir):
    """`collate_texts` makes a `PredictBatch` (defaults filled, lengths checked); the tools
    `predict_step` loads stay out of the state dict and are loaded once."""
    from tts_lightning.data.predict import PredictBatch, TextsDataset, collate_texts
    from tts_lightning.model.generation import generation_defaults

    items = list(TextsDataset(["Hi.", "Bye."], ["alice", "bob"], languages={"alice": "english"}))
    batch = collate_texts(items)
    assert isinstance(batch, PredictBatch) and len(batch) == 4
    assert batch.texts == ["Hi.", "Hi.", "Bye.", "Bye."] and batch.speakers == ["alice", "bob"] * 2
    assert batch.languages == ["english", "auto"] * 2 and batch.ids == ["0000", "0000", "0001", "0001"]
    assert batch.padding == [False] * 4
    plain = PredictBatch.from_mapping({"text": ["Hi."], "speaker": ["bob"]}, batch_idx=3)
    assert (plain.languages, plain.ids, plain.padding) == (["auto"], ["0003_0"], [False])
    with pytest.raises(ValueError, match="2 texts but 1 speakers"):
        PredictBatch.build(["a", "b"], ["alice"])

    module = Qwen3TTSModule(str(tiny_dir), speakers=["alice", "bob"])
    keys = set(module.state_dict())
    tools = module.predict_tools()
    assert module.predict_tools() is tools  # loaded once
    assert tools.generation == generation_defaults(tiny_dir) and tools.generation  # the directory's sampling
    assert set(module.state_dict()) == keys and "_predict_tools" not in module.hparams


def test_settings_are_the_hparams(tiny_dir):
    """One value under two names: an edit of either after construction is what the optimizer uses and
    what a checkpoint saves (Lightning's learning-rate finder writes the attribute)."""
    module = Qwen3TTSModule(str(tiny_dir), speakers=["alice"], learning_rate=1e-3, warmup_steps=0)
    module.hparams.learning_rate = 2e-4
    assert module.learning_rate == 2e-4
    module.weight_decay = 0.5
    assert module.hparams["weight_decay"] == 0.5
    import lightning as L

    module.configure_model()
    module.trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    (group,) = module.configure_optimizers()["optimizer"].param_groups
    assert group["lr"] == 2e-4 and group["weight_decay"] == 0.5
    # The default freeze list is copied, not shared between modules.
    module.freeze_patterns.append("talker.codec_head")
    assert Qwen3TTSModule(str(tiny_dir), speakers=["alice"]).freeze_patterns == ["speaker_encoder"]


def _learning_rates(module: Qwen3TTSModule, max_steps: int, steps: int) -> tuple[list[float], torch.optim.Optimizer]:
    """The learning rate at each of the first ``steps`` optimizer steps of a ``max_steps`` run."""
    import lightning as L

    module.trainer = L.Trainer(max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates, optimizer


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_learning_rate_warms_up_then_holds_or_decays_to_zero(tiny_dir, schedule):
    """Linear warm-up from 0 over `warmup_steps` optimizer steps, then the peak (constant) or a cosine
    that reaches 0 at the trainer's last step."""
    module = Qwen3TTSModule(str(tiny_dir), speakers=["alice"], learning_rate=1e-3, warmup_steps=4, lr_schedule=schedule)
    module.configure_model()
    rates, optimizer = _learning_rates(module, max_steps=20, steps=20)
    assert rates[:5] == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3])
    if schedule == "constant":
        assert rates[4:] == pytest.approx([1e-3] * 16)
    else:
        assert all(a > b for a, b in zip(rates[4:], rates[5:]))  # decaying
        assert rates[12] == pytest.approx(5e-4)  # half-way through the decay
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # at the last step


def test_warmup_ratio_is_a_fraction_of_the_run(tiny_dir):
    """``warmup_ratio`` warms up over that fraction of the trainer's optimizer steps (rounded up), so a
    short run reaches its peak; a non-zero ``warmup_steps`` wins (Hugging Face's rule: a config's
    ratio and a command line's steps); a run of unknown length is refused."""
    import lightning as L

    from tts_lightning.errors import ConfigError

    module = Qwen3TTSModule(str(tiny_dir), speakers=["alice"], learning_rate=1e-3, warmup_ratio=0.1)
    module.configure_model()
    rates, _ = _learning_rates(module, max_steps=30, steps=6)
    assert rates == pytest.approx([0.0, 1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3, 1e-3])  # 3 = 10% of 30 steps
    module.warmup_steps = 1  # as `--model.warmup_steps 1` over a config's ratio
    scheduler = module.configure_optimizers()["lr_scheduler"]["scheduler"]
    assert scheduler.lr_lambdas[0](1) == pytest.approx(1.0)  # the peak after one step
    with pytest.raises(ConfigError, match="warmup_ratio"):
        Qwen3TTSModule(str(tiny_dir), speakers=["alice"], warmup_ratio=1.5)
    module.warmup_steps = 0
    module.trainer = L.Trainer(max_steps=-1, max_epochs=-1, logger=False, enable_checkpointing=False)
    with pytest.raises(ConfigError, match="max_steps or trainer.max_epochs"):
        module.configure_optimizers()


def test_a_resumed_run_adopts_a_changed_speaker_embedding_and_says_so(tiny_dir, make_datamodule, tmp_path, recwarn):
    """A run starts with every speaker's prepared embedding in its table, even one no batch has
    shown yet. The checkpoint's speaker table against the prepared one at a resume: equal, nothing is said;
    a speaker whose references changed since (here: the checkpoint's row edited, as a run prepared
    with other reference clips would hold) gets the prepared embedding, which the batches carry and
    export writes, with a warning naming it."""
    import lightning as L

    from tts_lightning.model.checkpoint import load_training_checkpoint

    torch.set_num_threads(1)

    def fit(steps, ckpt_path=None, root=tmp_path / "run"):
        data = make_datamodule()
        module = Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names, learning_rate=1e-3)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0,
            logger=False, default_root_dir=root, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[L.pytorch.callbacks.ModelCheckpoint(root, filename="{step}", every_n_train_steps=1)],
        )  # fmt: skip
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return data.speaker_embeddings(), module

    prepared, module = fit(1)
    first = tmp_path / "run" / "step=1.ckpt"
    held = load_training_checkpoint(first).state_dict["speaker_embeddings"]
    filled = [row for row in range(len(held)) if held[row].abs().sum() > 0]
    # Step 1's batch is one clip, of one speaker: the other's row comes from the prepared table at the
    # start (export needs every speaker's row; a short run left it empty and export refused the run).
    assert len(filled) == len(held) == 2 and all(torch.equal(held[row], prepared[row]) for row in filled)
    recwarn.clear()
    fit(2, first, tmp_path / "again")
    assert not [w for w in recwarn if "prepared embedding differs" in str(w.message)]

    checkpoint = torch.load(first, weights_only=False)
    checkpoint["state_dict"]["speaker_embeddings"][filled[0]] += 0.5  # as from other references
    edited = tmp_path / "edited.ckpt"
    torch.save(checkpoint, edited)
    name = module.speakers[filled[0]]
    with pytest.warns(UserWarning, match=rf"speaker\(s\) '{name}': the prepared embedding differs from the one"):
        _, resumed = fit(2, edited, tmp_path / "resumed")
    assert torch.equal(resumed.speaker_embeddings[filled[0]], prepared[filled[0]])
