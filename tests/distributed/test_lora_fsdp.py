"""LoRA with 2 real FSDP ranks on CPU (`configs/tiny-cpu-lora.yaml`): it trains, only the adapters
get gradients and move, `SpeakerSamplesCallback` speaks the adapted weights, `predict` speaks from the
checkpoint, checkpoints hold the adapters only (under a tenth of full fine-tuning's), a run killed
mid-epoch resumes to the same adapters (sharded and full checkpoints), `load_from_checkpoint` reads a
full one, and export merges them into a custom_voice directory whose loss equals the training
module's and that qwen_tts speaks with.

FSDP2 (`configs/tiny-cpu-lora-fsdp2.yaml`): one run killed mid-epoch and resumed from its sharded
checkpoint (writing full checkpoints from then on) ends with the FSDP1 run's adapters; its checkpoints
hold no frozen tensor, its frozen weights have no gradient and stay the pretrained ones, its samples
are FSDP1's, and export merges its adapters. A short bf16-mixed run resumed from its full checkpoint
stores the frozen base in bf16 and starts from exactly the saved adapters and AdamW state.

Runs: one uninterrupted run (sharded checkpoints, with the checking and sampling callbacks), and per
checkpoint format one run killed mid-epoch and resumed; the resumed full-format run is also the full
checkpoint the other tests read (training does not depend on the format, so both resumed runs are
compared with the one uninterrupted run)."""

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_runs import data_args, newest_last
from tiny_runs import fit_args as shared_fit_args

from tts_lightning.data.demo import demo_dir
from tts_lightning.model.checkpoint import CheckpointReader, load_training_checkpoint

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONFIG = REPO / "configs" / "tiny-cpu-lora.yaml"
CONFIG_FSDP2 = REPO / "configs" / "tiny-cpu-lora-fsdp2.yaml"
STEPS, CHECKPOINT_EVERY, CRASH_AT = 8, 4, 6
CHECK_FROZEN = '{"class_path": "lora_callbacks.CheckFrozen"}'
CRASH = f'{{"class_path": "crash_callbacks.CrashAt", "init_args": {{"step": {CRASH_AT}}}}}'
TEXTS = ["Good morning.", "See you soon."]
SPEAKERS = ["alice", "bob"]
SAMPLE_TOKENS = 24


def samples_callback(every_n_val_epochs: int) -> str:
    """Samples logged to TensorBoard at every N-th validation; no resemblyzer needed."""
    return json.dumps(
        {
            "class_path": "tts_lightning.callbacks.SpeakerSamplesCallback",
            "init_args": {
                "every_n_val_epochs": every_n_val_epochs,
                "texts": TEXTS,
                "max_new_tokens": SAMPLE_TOKENS,
                "similarity": False,
                "baseline": False,
            },
        }
    )


SAMPLES = samples_callback(2)  # at the second validation: the last step


def events(run_dir, *, audio=False):
    """The run's TensorBoard events (with ``audio``: of the launch that logged audio)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = sorted(Path(run_dir).rglob("events.out.tfevents.*"))
    assert found, f"no TensorBoard event file under {run_dir}"
    for event_file in found:
        acc = EventAccumulator(str(event_file.parent), size_guidance={"audio": 0, "scalars": 0})
        acc.Reload()
        if not audio or acc.Tags()["audio"]:
            return acc
    raise AssertionError(f"no audio logged under {run_dir}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_dir):
    import shutil

    root = tmp_path_factory.mktemp("lora")
    shutil.copytree(demo_dir(), root / "demo")
    return root


@pytest.fixture(scope="module")
def cli(run_cli):
    """The shared `run_cli`, with this folder on the ranks' path (the callbacks of lora_callbacks.py)."""

    def run(*args, cwd, check=True, timeout=900):
        return run_cli(*map(str, args), cwd=cwd, check=check, timeout=timeout, pythonpath=(HERE,))

    return run


def fit_args(workdir, tiny_dir, run, *extra, config=CONFIG):
    """`fit` of ``config`` for STEPS steps, validated and checkpointed every CHECKPOINT_EVERY."""
    steps = ("--trainer.max_steps", STEPS, "--trainer.val_check_interval", CHECKPOINT_EVERY)
    return shared_fit_args(config, workdir, tiny_dir, run, *steps, *extra)


@pytest.fixture(scope="module")
def straight(workdir, tiny_dir, cli):
    """The uninterrupted LoRA run (sharded checkpoints): it checks gradients and frozen weights on
    every rank, and samples the speakers at the last validation."""
    run_dir = workdir / "straight"
    proc = cli(
        *fit_args(
            workdir,
            tiny_dir,
            "straight",
            "--trainer.strategy.init_args.state_dict_type",
            "sharded",
            f"--trainer.callbacks+={CHECK_FROZEN}",
            f"--trainer.callbacks+={SAMPLES}",
        ),
        cwd=workdir,
    )
    return run_dir, proc


@pytest.fixture(scope="module")
def resumed(workdir, tiny_dir, cli):
    """resumed(state_dict_type) -> run folder: a run killed at step CRASH_AT (after the checkpoint
    at CHECKPOINT_EVERY) and resumed with ``--ckpt_path last`` to STEPS; each format runs once."""
    done = {}

    def get(state_dict_type):
        if state_dict_type not in done:
            run = workdir / f"resumed-{state_dict_type}"
            common = ("--trainer.strategy.init_args.state_dict_type", state_dict_type)
            crashed = cli(
                *fit_args(workdir, tiny_dir, run.name, *common, f"--trainer.callbacks+={CRASH}"),
                cwd=workdir,
                check=False,
            )
            assert crashed.returncode != 0 and f"exits at global_step {CRASH_AT}" in crashed.stdout
            assert load_training_checkpoint(run / "checkpoints" / "last.ckpt").global_step == CHECKPOINT_EVERY
            again = cli(*fit_args(workdir, tiny_dir, run.name, *common, "--ckpt_path", "last"), cwd=workdir)
            assert "Restoring states from the checkpoint path" in again.stdout + again.stderr
            done[state_dict_type] = run
        return done[state_dict_type]

    return get


@pytest.fixture(scope="module")
def fsdp2(workdir, tiny_dir, cli):
    """The FSDP2 LoRA run: killed at step CRASH_AT (after the sharded checkpoint at CHECKPOINT_EVERY),
    resumed from that folder with ``--ckpt_path last`` to STEPS with full checkpoints (the sharded
    step-CHECKPOINT_EVERY one stays as a top-k checkpoint) and CheckFrozen. Returns (run folder,
    the resumed launch's output)."""
    run = workdir / "fsdp2"
    crashed = cli(
        *fit_args(workdir, tiny_dir, run.name, f"--trainer.callbacks+={CRASH}", config=CONFIG_FSDP2),
        cwd=workdir,
        check=False,
    )
    assert crashed.returncode != 0 and f"exits at global_step {CRASH_AT}" in crashed.stdout, crashed.stdout[-3000:]
    last = run / "checkpoints" / "last.ckpt"
    assert last.is_dir() and load_training_checkpoint(last).global_step == CHECKPOINT_EVERY
    again = cli(
        *fit_args(
            workdir,
            tiny_dir,
            run.name,
            "--trainer.strategy.init_args.state_dict_type",
            "full",
            f"--trainer.callbacks+={CHECK_FROZEN}",
            f"--trainer.callbacks+={samples_callback(1)}",  # this launch validates once, at STEPS
            "--ckpt_path",
            "last",
            config=CONFIG_FSDP2,
        ),
        cwd=workdir,
    )
    output = again.stdout + again.stderr
    assert "Restoring states from the checkpoint path" in output
    return run, output


def assert_frozen_checked(output, backwards):
    """Both ranks' CheckFrozen ran: ``backwards`` backward passes without frozen gradients, the frozen
    weights unchanged and some lora_B moved."""
    for rank in (0, 1):
        assert re.search(
            rf"\[CheckFrozen\] rank {rank}: \d+ frozen weights unchanged, \d+ lora_B moved, "
            rf"{backwards} backward passes checked",
            output,
        ), output[-3000:]


def fsdp2_sharded(run_dir):
    """The FSDP2 run's sharded checkpoint (step CHECKPOINT_EVERY, written before the crash)."""
    (found,) = [c for c in (run_dir / "checkpoints").glob(f"step{CHECKPOINT_EVERY:06d}-*.ckpt") if c.is_dir()]
    return found


def test_fsdp2_lora_resumes_to_the_fsdp1_adapters(straight, fsdp2):
    """Same batches, same adapters as FSDP1's uninterrupted run, after a crash and a resume from the
    sharded checkpoint (model and AdamW state read key by key into the DTensor shards)."""
    run_dir, output = fsdp2
    assert_frozen_checked(output, STEPS - CHECKPOINT_EVERY)
    assert len(re.findall(r"\[rank \d\] FSDP2 fully_shard", output)) == 2
    expected = load_training_checkpoint(newest_last(straight[0]))
    final = load_training_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert final.path.is_file() and final.global_step == STEPS
    assert final.state_dict.keys() == expected.state_dict.keys()
    for key, value in expected.state_dict.items():
        torch.testing.assert_close(final.state_dict[key], value, atol=1e-5, rtol=1e-5, msg=key)


def test_fsdp2_lora_samples_speak_the_adapted_weights(straight, fsdp2):
    """Under FSDP2 the callback gathers the DTensor shards, frozen base included, and generates with a
    merged copy: at the last step it speaks what FSDP1's run spoke (whose audio is the merged export's,
    test_samples_speak_the_adapted_weights), the adapters being equal within 1e-5."""
    import soundfile as sf

    fsdp1, fsdp2_events = events(straight[0], audio=True), events(fsdp2[0], audio=True)
    for s in range(len(SPEAKERS)):
        for i in range(len(TEXTS)):
            tag = f"samples/{SPEAKERS[s]}/{i}"
            (expected,), (spoken,) = fsdp1.Audio(tag), fsdp2_events.Audio(tag)
            assert spoken.step == expected.step == STEPS
            a, sr = sf.read(io.BytesIO(spoken.encoded_audio_string), dtype="float32")
            b, _ = sf.read(io.BytesIO(expected.encoded_audio_string), dtype="float32")
            assert sr == 24_000 and a.shape == b.shape and np.abs(a - b).max() < 2e-4, tag


def test_fsdp2_lora_checkpoints_hold_no_frozen_tensor(fsdp2):
    """Neither format holds a frozen tensor: the module state is the adapters and the speaker table,
    the optimizer state the adapters' (the frozen shards are never gathered to be dropped later)."""
    from torch.distributed.checkpoint import FileSystemReader

    run_dir, _ = fsdp2
    sharded = fsdp2_sharded(run_dir)
    for ckpt in (sharded, run_dir / "checkpoints" / "last.ckpt"):
        state = load_training_checkpoint(ckpt).state_dict
        assert all(".lora_" in k or k == "speaker_embeddings" for k in state), sorted(state)[:5]
        assert any(".code_predictor." in k for k in state) and state["speaker_embeddings"].abs().sum() > 0
    stored = FileSystemReader(str(sharded)).read_metadata().state_dict_metadata
    assert any(k.startswith("optimizer_0.state.") for k in stored)
    weights = [k for k in stored if ".model." in k]  # module and optimizer state of the model's parameters
    assert weights and all(".lora_" in k for k in weights), sorted(k for k in weights if ".lora_" not in k)[:5]


def test_fsdp2_bf16_mixed_resumes_from_a_full_checkpoint_with_a_bf16_base(fsdp2, workdir, tiny_dir, cli):
    """Two bf16-mixed steps resumed from the FSDP2 run's full checkpoint: the frozen base is stored in
    bf16 (cast on the meta device before sharding), the adapters in fp32, and training starts from
    exactly the saved adapters, speaker table and AdamW state."""
    run_dir, _ = fsdp2
    last = run_dir / "checkpoints" / "last.ckpt"
    resumed = json.dumps({"class_path": "lora_callbacks.CheckResumed", "init_args": {"path": str(last)}})
    proc = cli(
        *fit_args(
            workdir,
            tiny_dir,
            "fsdp2-bf16",
            "--trainer.precision",
            "bf16-mixed",
            "--trainer.max_steps",
            STEPS + 2,
            "--trainer.limit_val_batches",
            0,
            "--trainer.enable_checkpointing",
            "false",
            '--trainer.callbacks+={"class_path": "lora_callbacks.ReportDtypes"}',
            f"--trainer.callbacks+={resumed}",
            "--ckpt_path",
            last,
            config=CONFIG_FSDP2,
        ),
        cwd=workdir,
    )
    output = proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"[ReportDtypes] rank {rank}: frozen torch.bfloat16, trainable torch.float32" in output, output[-3000:]
        assert re.search(
            rf"\[CheckResumed\] rank {rank}: \d+ tensors and \d+ optimizer states as saved at step {STEPS}", output
        )
    assert f"`Trainer.fit` stopped: `max_steps={STEPS + 2}` reached" in output


def test_lora_trains_with_two_fsdp_ranks(straight):
    run_dir, proc = straight
    output = proc.stdout + proc.stderr
    assert_frozen_checked(output, STEPS)
    assert len(re.findall(r"\[rank \d\] FSDP FULL_SHARD", output)) == 2
    val = [e.value for e in events(run_dir).Scalars("val/loss")]
    assert len(val) == 2 and val[-1] < val[0], val
    state = load_training_checkpoint(newest_last(run_dir)).state_dict
    assert state and all(".lora_" in k or k == "speaker_embeddings" for k in state), sorted(state)[:5]
    assert any(".code_predictor." in k for k in state) and state["speaker_embeddings"].abs().sum() > 0


def test_samples_speak_the_adapted_weights(straight, workdir, tiny_dir):
    """Under FSDP the callback gathers the shards and generates with a merged copy (rank 0): its
    audio at the last step is what the merged export of that step's checkpoint speaks with the same
    seed, and not what the base model speaks."""
    import soundfile as sf

    from tts_lightning.model.export import export_custom_voice
    from tts_lightning.model.generation import decode_codes, generate_codes
    from tts_lightning.model.loading import MetaWeights, build_empty_model
    from tts_lightning.model.pretrained import check_pretrained, load_speech_tokenizer, load_text_tokenizer
    from tts_lightning.model.sequence import tokenize_text

    run_dir, _ = straight
    acc = events(run_dir)
    ckpt = newest_last(run_dir)
    assert load_training_checkpoint(ckpt, keys=["speaker_embeddings"]).global_step == STEPS
    table = load_training_checkpoint(ckpt, keys=["speaker_embeddings"]).state_dict["speaker_embeddings"]
    voice = export_custom_voice(ckpt, workdir / "voice-samples", dtype="fp32")
    info = check_pretrained(tiny_dir)
    tokenizer, speech = load_text_tokenizer(info), load_speech_tokenizer(info)
    rows = [(s, i) for s in range(len(SPEAKERS)) for i in range(len(TEXTS))]

    def speak(model):
        # Capped at SAMPLE_TOKENS frames: generated with one token more (the official generation
        # expands all tokens but the last into frames) and cut there, as the callback does.
        codes = generate_codes(
            model.eval(),
            [tokenize_text(tokenizer, TEXTS[i]) for _, i in rows],
            torch.stack([table[s] for s, _ in rows]),
            ["english"] * len(rows),
            max_new_tokens=SAMPLE_TOKENS + 1,
            seed=0,
        )
        return decode_codes(speech, [c[:SAMPLE_TOKENS] for c in codes])

    merged = MetaWeights(m := build_empty_model(info), info).materialize_all(m)
    merged.load_state_dict(load_file(str(voice / "model.safetensors")), strict=False)  # no speaker encoder
    base = MetaWeights(m := build_empty_model(info), info).materialize_all(m)
    differs = 0
    for (s, i), wav, base_wav in zip(rows, speak(merged), speak(base)):
        clips = acc.Audio(f"samples/{SPEAKERS[s]}/{i}")
        assert [e.step for e in clips] == [STEPS]  # every second validation: the last one only
        logged, sr = sf.read(io.BytesIO(clips[0].encoded_audio_string), dtype="float32")
        assert sr == 24_000 and logged.shape == wav.shape
        assert np.abs(logged - np.clip(wav, -1, 1)).max() < 2e-4  # 16-bit quantisation in the event file
        differs += int(logged.shape != base_wav.shape or np.abs(logged - np.clip(base_wav, -1, 1)).max() > 1e-2)
    assert differs  # the adapters changed what is spoken


def test_predict_speaks_from_a_lora_checkpoint(straight, workdir, tiny_dir, cli):
    """`tts-lightning predict` with the sharded LoRA checkpoint on 2 FSDP ranks: every text x speaker
    is written once, at 24 kHz, as the checkpoint (adapters on the pretrained base) speaks it."""
    from predicted_speech import assert_written_by_the_checkpoint, greedy_copy

    run_dir, _ = straight
    out = workdir / "predicted"
    texts = ["Hello there.", "How are you today?", "Goodbye."]
    greedy = greedy_copy(tiny_dir, workdir / "greedy")
    ckpt = newest_last(run_dir)
    proc = cli(
        "predict",
        "--config",
        CONFIG,
        *data_args(workdir, greedy),
        "--ckpt_path",
        ckpt,
        "--trainer.logger",
        "false",
        "--data.predict_texts",
        "[" + ", ".join(texts) + "]",
        "--trainer.callbacks+=tts_lightning.data.predict.PredictionWriter",
        "--trainer.callbacks.output_dir",
        out,
        cwd=workdir,
        timeout=600,
    )
    assert len(re.findall(r"\[rank \d\] FSDP FULL_SHARD", proc.stdout + proc.stderr)) == 2
    written = sorted(p.name for p in out.glob("*.wav"))
    assert written == sorted(f"{i:04d}_{s}.wav" for i in range(len(texts)) for s in SPEAKERS)
    assert_written_by_the_checkpoint(out, ckpt, greedy, texts, SPEAKERS)


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_resume_gives_the_same_adapters(straight, resumed, state_dict_type):
    run = resumed(state_dict_type)
    expected = load_training_checkpoint(newest_last(straight[0]))
    again = load_training_checkpoint(newest_last(run))
    assert again.path.is_dir() == (state_dict_type == "sharded")
    assert expected.global_step == again.global_step == STEPS
    assert expected.state_dict.keys() == again.state_dict.keys()
    for key, value in expected.state_dict.items():
        torch.testing.assert_close(again.state_dict[key], value, atol=1e-6, rtol=1e-5, msg=key)


def test_lora_checkpoints_are_under_a_tenth_of_full_fine_tuning(
    straight, resumed, fsdp1_reference, fsdp2_full_reference
):
    """Against a full fine-tuning checkpoint of the same format: the session's seeded full fine-tuning
    runs (conftest.py of this folder; FSDP1 with sharded checkpoints, FSDP2 with full ones: the size
    depends on the format, not on the step or the strategy). Full format: under a tenth on disk.
    Sharded: the tensors (adapters, speaker table, AdamW state) are under a tenth too, but
    torch.distributed.checkpoint adds ~2 KB per tensor shard per rank (a torch.save zip record each)
    plus ~0.3 KB of metadata, which on the tiny model's ~450 adapter shards is four fifths of the
    folder: on disk it stays at about a tenth."""
    sizes = {
        "sharded": (newest_last(straight[0]), newest_last(fsdp1_reference[0])),
        "full": (newest_last(resumed("full")), newest_last(fsdp2_full_reference[0])),
    }
    assert sizes["sharded"][1].is_dir() and sizes["full"][1].is_file()
    for kind, (lora, full) in sizes.items():
        print(
            f"LoRA / full fine-tuning checkpoint ({kind}): {size_of(lora)} / {size_of(full)} bytes on disk "
            f"= {size_of(lora) / size_of(full):.4f}; tensors {tensor_bytes(lora)} / {tensor_bytes(full)} "
            f"= {tensor_bytes(lora) / tensor_bytes(full):.4f}"
        )
    lora, full = sizes["full"]
    assert size_of(lora) < 0.1 * size_of(full), (size_of(lora), size_of(full))
    lora, full = sizes["sharded"]
    assert tensor_bytes(lora) < 0.1 * tensor_bytes(full), (tensor_bytes(lora), tensor_bytes(full))
    assert size_of(lora) < 0.11 * size_of(full), (size_of(lora), size_of(full))


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def tensor_bytes(path: Path) -> int:
    """The bytes of the tensors a checkpoint holds (module state and optimizer state)."""
    if not path.is_dir():
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        found: list[torch.Tensor] = []

        def walk(value):
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, dict):
                for v in value.values():
                    walk(v)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    walk(v)

        walk({"state_dict": raw["state_dict"], "optimizer_states": raw.get("optimizer_states")})
        return sum(t.numel() * t.element_size() for t in found)
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return sum(
        torch.Size(m.size).numel() * torch.empty(0, dtype=m.properties.dtype).element_size()
        for m in metadata.values()
        if hasattr(m, "size")
    )


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_load_from_checkpoint_reads_a_lora_checkpoint(straight, resumed, tiny_dir, state_dict_type):
    """`Qwen3TTSModule.load_from_checkpoint` of a LoRA checkpoint, a folder (sharded) or a file: the
    base from the pretrained directory, the adapters and the speaker table from the checkpoint."""
    from tts_lightning import Qwen3TTSModule
    from tts_lightning.model.loading import WeightReader
    from tts_lightning.model.lora import checkpoint_key, is_adapter_key
    from tts_lightning.model.pretrained import check_pretrained
    from tts_lightning.model.row_blocks import row_slices

    ckpt = newest_last(straight[0] if state_dict_type == "sharded" else resumed("full"))
    assert ckpt.is_dir() == (state_dict_type == "sharded")
    stored = load_training_checkpoint(ckpt).state_dict
    module = Qwen3TTSModule.load_from_checkpoint(ckpt)
    assert module.adapter is not None and module.adapter.rank == 4
    state = module.state_dict()
    for key, value in stored.items():
        torch.testing.assert_close(state[key], value, atol=0, rtol=0, msg=key)
    reader = WeightReader(check_pretrained(tiny_dir))
    slices = row_slices(module.model)  # the text embedding's row blocks: slices of the pretrained tensor
    for name, param in module.model.named_parameters():
        if not is_adapter_key(name):
            whole, start, stop = slices.get(name, (name, 0, None))
            assert torch.equal(param, reader.read(checkpoint_key(whole))[start:stop].float()), name


@pytest.mark.parametrize("state_dict_type", ["sharded", "full", "fsdp2-sharded"])
def test_merged_export_equals_the_adapter_model(request, workdir, tiny_dir, make_datamodule, state_dict_type):
    import inspect

    from tts_lightning import Qwen3TTSModule
    from tts_lightning.model.export import export_custom_voice
    from tts_lightning.model.loading import MetaWeights, build_empty_model
    from tts_lightning.model.loss import compute_loss
    from tts_lightning.model.pretrained import check_pretrained

    if state_dict_type == "fsdp2-sharded":  # FSDP2's layout of the module state ("state_dict.<key>")
        ckpt = fsdp2_sharded(request.getfixturevalue("fsdp2")[0])
    elif state_dict_type == "sharded":
        ckpt = newest_last(request.getfixturevalue("straight")[0])
    else:
        ckpt = newest_last(request.getfixturevalue("resumed")("full"))
    out = export_custom_voice(ckpt, workdir / f"voice-{state_dict_type}", dtype="fp32")
    reader = CheckpointReader(ckpt)
    accepted = inspect.signature(Qwen3TTSModule).parameters
    module = Qwen3TTSModule(**{k: v for k, v in reader.hyper_parameters.items() if k in accepted})
    module.configure_model()
    missing, unexpected = module.load_state_dict(reader.read(reader.tensor_keys()), strict=False)
    assert not unexpected and not (set(missing) & module.trainable_keys)

    info = check_pretrained(tiny_dir)
    plain = MetaWeights(model := build_empty_model(info), info).materialize_all(model)
    exported = load_file(str(out / "model.safetensors"))
    assert not any(".lora_" in k or ".base_layer." in k for k in exported)
    plain.load_state_dict(exported, strict=False)  # all but the dropped speaker encoder

    data = make_datamodule()
    data.setup("fit")
    batch = next(iter(data.val_dataloader()))
    with torch.no_grad():
        adapted = module.eval()(batch).loss
        merged = compute_loss(plain.eval().talker, batch, module.hparams.sub_talker_loss_weight).loss
        base = compute_loss(
            MetaWeights(m := build_empty_model(info), info).materialize_all(m).eval().talker,
            batch,
            module.hparams.sub_talker_loss_weight,
        ).loss
    assert abs(float(adapted) - float(merged)) < 1e-5, (float(adapted), float(merged))
    assert abs(float(adapted) - float(base)) > 1e-4  # the adapters changed the model

    from qwen_tts import Qwen3TTSModel

    voice = Qwen3TTSModel.from_pretrained(str(out))
    assert set(voice.get_supported_speakers()) == set(SPEAKERS)
    torch.manual_seed(0)
    wavs, sr = voice.generate_custom_voice(text="Hello there.", speaker="alice", max_new_tokens=24)
    assert sr == 24_000 and wavs[0].ndim == 1 and wavs[0].size > 0


def test_adapter_only_export_is_peft_format(straight, workdir, tiny_dir, cli):
    from peft import PeftModel

    from tts_lightning.model.loading import MetaWeights, build_empty_model
    from tts_lightning.model.lora import MergedWeights
    from tts_lightning.model.pretrained import check_pretrained

    ckpt = newest_last(straight[0])
    out = workdir / "adapter"
    cli("export", "--ckpt", ckpt, "--out", out, "--adapter-only", cwd=workdir)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    assert json.loads((out / "speakers.json").read_text())["speakers"] == SPEAKERS

    info = check_pretrained(tiny_dir)
    base = MetaWeights(model := build_empty_model(info), info).materialize_all(model)
    peft_model = PeftModel.from_pretrained(base, str(out))
    weights = MergedWeights(peft_model.base_model.model)
    state = load_training_checkpoint(ckpt).state_dict
    layer = "talker.model.layers.0.self_attn.q_proj"
    a, b = state[f"model.{layer}.lora_A.default.weight"], state[f"model.{layer}.lora_B.default.weight"]
    expected = MetaWeights(m := build_empty_model(info), info).materialize_all(m).get_parameter(f"{layer}.weight")
    torch.testing.assert_close(weights[f"{layer}.weight"], expected + 2.0 * (b @ a), atol=1e-6, rtol=1e-5)


def test_validate_a_lora_checkpoint_reports_the_logged_val_loss(straight, workdir, tiny_dir, cli):
    import csv

    run_dir, _ = straight
    ckpt = next(c for c in sorted(run_dir.rglob("*.ckpt")) if c.name != "last.ckpt")
    logged = float(re.search(r"val_loss(\d+\.\d+)", ckpt.name).group(1))
    cli(
        "validate",
        "--config",
        CONFIG,
        *data_args(workdir, tiny_dir),
        "--trainer.logger",
        "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir",
        workdir / "validate",
        "--ckpt_path",
        ckpt,
        cwd=workdir,
    )
    rows = list(csv.DictReader(open(next((workdir / "validate").rglob("metrics.csv")))))
    reported = float(next(r["val/loss"] for r in rows if r.get("val/loss")))
    assert abs(reported - logged) < 1e-4, (reported, logged)


def test_bf16_mixed_keeps_the_frozen_base_in_bf16(workdir, tiny_dir, cli):
    """Under bf16-mixed the frozen base is stored in bf16 (the adapters stay fp32) and it trains."""
    proc = cli(
        *fit_args(
            workdir,
            tiny_dir,
            "bf16",
            "--trainer.precision",
            "bf16-mixed",
            "--trainer.max_steps",
            2,
            "--trainer.val_check_interval",
            2,
            "--trainer.enable_checkpointing",
            "false",
            '--trainer.callbacks+={"class_path": "lora_callbacks.ReportDtypes"}',
            f"--trainer.callbacks+={CHECK_FROZEN}",
        ),
        cwd=workdir,
    )
    output = proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"[ReportDtypes] rank {rank}: frozen torch.bfloat16, trainable torch.float32" in output, output[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in output
    assert_frozen_checked(output, 2)  # it trains: the adapters moved, the bf16 base equals the pretrained one
    assert "Support for Transformers < 5.6 is deprecated in PEFT" not in output  # tts_lightning.console
