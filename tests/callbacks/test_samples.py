"""SpeakerSamplesCallback: audio, spectrograms and speaker similarity in TensorBoard, in one process
and under 2-rank FSDP (through the CLI), without touching training's RNG; predict writes wav files."""

import io
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import soundfile as sf
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader

from tts_lightning import Qwen3TTSModule
from tts_lightning.callbacks import SpeakerSamplesCallback
from tts_lightning.data.predict import PredictionWriter, TextsDataset, collate_texts
from tts_lightning.errors import ConfigError
from tts_lightning.metrics import similarity_unavailable

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-cpu.yaml"
TEXTS = ["Good morning.", "See you soon."]
SPEAKERS = ["alice", "bob"]
needs_resemblyzer = pytest.mark.skipif(similarity_unavailable() is not None, reason=str(similarity_unavailable()))


def read_events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(Path(run_dir).rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file under {run_dir}"
    acc = EventAccumulator(str(events[0].parent), size_guidance={"audio": 0, "images": 0, "scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def check_audio(acc, steps):
    """Every speaker x text has a decodable 24 kHz clip at exactly `steps`, and a spectrogram."""
    tags = acc.Tags()
    for speaker in SPEAKERS:
        for i in range(len(TEXTS)):
            clips = acc.Audio(f"samples/{speaker}/{i}")
            assert [e.step for e in clips] == steps
            for event in clips:
                assert event.sample_rate == 24_000
                wav, sr = sf.read(io.BytesIO(event.encoded_audio_string))
                assert sr == 24_000 and len(wav) >= 2 * 1920 and np.abs(wav).max() > 0
            images = acc.Images(f"spectrograms/{speaker}/{i}")
            assert [e.step for e in images] == steps
            assert images[0].height == 80 and images[0].width > 5
            figures = acc.Images(f"spectrograms_vs_real/{speaker}/{i}")  # beside the real clip, with axes
            assert [e.step for e in figures] == steps and figures[0].width == 800
        real = acc.Audio(f"real/{speaker}")  # the real voice, once (with the baseline at step 0)
        assert len(real) == 1 and real[0].step in (0, steps[0]) and real[0].sample_rate == 24_000
    assert "samples/text_0/text_summary" in tags["tensors"]  # what was said


class RNGProbe(Callback):
    """Records the global RNG state when its on_validation_epoch_end runs."""

    def __init__(self):
        self.states = []

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.states.append(torch.get_rng_state().clone())


@pytest.mark.slow  # a fit with two sampling validations: over a minute of `make test-fast` under load
@needs_resemblyzer
def test_single_process_fit_logs_samples_and_similarity(tiny_dir, make_datamodule, held_out_manifest, tmp_path):
    L.seed_everything(0)
    data = make_datamodule()
    module = Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names)
    samples = SpeakerSamplesCallback(
        every_n_val_epochs=2, texts=TEXTS, max_new_tokens=24, seed=0, held_out=str(held_out_manifest)
    )
    before, after = RNGProbe(), RNGProbe()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        val_check_interval=1,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[before, samples, after],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)

    assert samples.validation_runs == 4  # the sanity check is not counted
    # The callback ran twice (runs 2 and 4), and training's RNG is as if it had not run at all.
    assert len(before.states) == len(after.states) == 4
    for a, b in zip(before.states, after.states):
        assert torch.equal(a, b)
    acc = read_events(tmp_path / "tb")
    check_audio(acc, steps=[2, 4])  # every 2nd validation run; never the sanity check (step 0)
    # Through `pl_module.log` (Lightning picks the step of validation metrics), and per speaker at
    # the samples' step; the overall score is the mean over all samples (2 per speaker).
    scores = [e.value for e in acc.Scalars("val/speaker_similarity")]
    per_speaker = {s: acc.Scalars(f"val/speaker_similarity/{s}") for s in SPEAKERS}
    assert len(scores) == 2 and all(-1.0 <= v <= 1.0 for v in scores)
    for run, score in enumerate(scores):
        assert [e.step for e in per_speaker["alice"]] == [2, 4]
        assert score == pytest.approx(np.mean([per_speaker[s][run].value for s in SPEAKERS]), abs=1e-5)
    # Logged through Lightning: a ModelCheckpoint could monitor it.
    assert "val/speaker_similarity" in trainer.callback_metrics
    assert module.training  # back in train mode
    check_pace_and_baseline(acc, runs=2)
    assert set(samples.baseline_values) == {
        "speaker_similarity",
        "speaking_rate_ratio",
        "eos_failure_rate",
        "zero_shot_similarity",
    }
    check_zero_shot(acc, tiny_dir, held_out_manifest, samples, steps=[2, 4])


def check_zero_shot(acc, tiny_dir, manifest, samples, steps):
    """The held-out speaker cloned at every round, and before training (step 0, the baseline round):
    the step-0 clones are what the official ICL ``generate_voice_clone`` of the untrained model gives
    from dave's first clip and transcript (same texts, seed and cap), scored against dave's other clip."""
    import json

    from qwen_tts import Qwen3TTSModel

    from tts_lightning.data.audio import load_audio
    from tts_lightning.metrics.speaker_similarity import SpeakerSimilarity, reference_embedding

    # Through Lightning, with val/speaker_similarity (at the step Lightning picks); per speaker at the
    # samples' step; the value before training once, at step 0, with the untrained weights' clones.
    events = acc.Scalars("val/zero_shot_similarity")
    assert [e.step for e in events] == [e.step for e in acc.Scalars("val/speaker_similarity")]
    assert all(-1.0 <= e.value <= 1.0 for e in events)
    assert [e.step for e in acc.Scalars("val/zero_shot_similarity/dave")] == steps
    (before,) = acc.Scalars("val/zero_shot_similarity_before")
    assert before.step == 0 and before.value == pytest.approx(samples.baseline_values["zero_shot_similarity"])
    assert [e.step for e in acc.Scalars("val/zero_shot_similarity_before/dave")] == [0]
    logged = []
    for i in range(len(TEXTS)):
        clips = acc.Audio(f"zero_shot_samples/dave/{i}")
        assert [e.step for e in clips] == [0, *steps] and clips[0].sample_rate == 24_000
        logged.append(sf.read(io.BytesIO(clips[0].encoded_audio_string), dtype="float32")[0])
    assert len(acc.Audio("real/dave")) == 1  # the reference, once

    first, other = [json.loads(line) for line in manifest.read_text().splitlines()]
    official = Qwen3TTSModel.from_pretrained(str(tiny_dir))
    prompt = official.create_voice_clone_prompt(
        ref_audio=str(manifest.parent / first["audio"]), ref_text=first["text"], x_vector_only_mode=False
    )
    torch.manual_seed(0)
    wavs, _ = official.generate_voice_clone(
        text=TEXTS, language=["english"] * 2, voice_clone_prompt=prompt * 2, max_new_tokens=25
    )
    for got, wav in zip(logged, wavs):
        assert got.shape == wav.shape
        np.testing.assert_allclose(got, np.clip(wav, -1, 1), atol=2 / 32768)
    reference = reference_embedding([load_audio(manifest.parent / other["audio"], 24_000).numpy()], 24_000)
    metric = SpeakerSimilarity(sample_rate=24_000)
    metric.update(list(wavs), reference)
    assert before.value == pytest.approx(float(metric.compute()), abs=1e-3)


def check_pace_and_baseline(acc, runs):
    """The pace and end-of-speech metrics at every sampled validation (logged through Lightning,
    with the similarity); the zero-shot baseline (untrained weights) once, at step 0, with its audio."""
    steps = [e.step for e in acc.Scalars("val/speaker_similarity")]
    assert len(steps) == runs
    for name in ("val/speaking_rate_ratio", "val/eos_failure_rate"):
        events = acc.Scalars(name)
        assert [e.step for e in events] == steps
    assert all(e.value > 0 for e in acc.Scalars("val/speaking_rate_ratio"))
    assert all(0.0 <= e.value <= 1.0 for e in acc.Scalars("val/eos_failure_rate"))
    for name in ("speaker_similarity", "speaking_rate_ratio", "eos_failure_rate"):
        (event,) = acc.Scalars(f"baseline/{name}")
        assert event.step == 0
    for speaker in SPEAKERS:
        assert [e.step for e in acc.Audio(f"baseline_samples/{speaker}/0")] == [0]
        assert [e.step for e in acc.Scalars(f"baseline/speaker_similarity/{speaker}")] == [0]


def test_needs_tensorboard_or_similarity(tiny_dir, make_datamodule, tmp_path, monkeypatch):
    """Without a TensorBoard logger and with similarity off, it warns once and does nothing."""
    data = make_datamodule()
    module = Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names)
    samples = SpeakerSamplesCallback(texts=TEXTS, max_new_tokens=4, similarity=False)
    monkeypatch.setattr(samples, "_generate", lambda *a: pytest.fail("generated with nothing to log to"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        val_check_interval=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=CSVLogger(tmp_path),
        callbacks=[samples],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning) as record:
        trainer.fit(module, datamodule=data)
    assert samples.validation_runs == 2
    assert sum("TensorBoard only" in str(w.message) for w in record) == 1  # said once


def test_without_resemblyzer_logs_audio_and_says_why_once(tiny_dir, make_datamodule, tmp_path, monkeypatch):
    import tts_lightning.metrics.speaker_similarity as similarity

    reason = (
        "resemblyzer is not importable (ModuleNotFoundError: no module named 'resemblyzer'); " + similarity.INSTALL_HINT
    )
    monkeypatch.setattr(similarity, "similarity_unavailable", lambda: reason)
    data = make_datamodule()
    module = Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names)
    samples = SpeakerSamplesCallback(texts=TEXTS, max_new_tokens=8)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        val_check_interval=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[samples],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning) as record:
        trainer.fit(module, datamodule=data)
    assert sum("tts-lightning[eval]" in str(w.message) for w in record) == 1
    acc = read_events(tmp_path / "tb")
    check_audio(acc, steps=[1, 2])
    assert not any("speaker_similarity" in tag for tag in acc.Tags()["scalars"])
    assert "val/speaker_similarity" not in trainer.callback_metrics


def cli_data_args(tiny_dir, demo_data):
    _, manifest, cache = demo_data
    return [
        "--config",
        CONFIG,
        "--data.pretrained",
        tiny_dir,
        "--data.train_manifest",
        manifest,
        "--data.cache_dir",
        cache,
        "--data.max_frames_per_batch",
        150,
    ]


@pytest.fixture(scope="module")
def fsdp_run(run_cli, tiny_dir, demo_data, held_out_manifest):
    """`tts-lightning fit` on 2 FSDP ranks with the callback; a deadlock fails on the timeout (the
    shared launcher, tests/conftest.py, kills every rank then, not only the launcher)."""
    if similarity_unavailable() is not None:
        pytest.skip(similarity_unavailable())
    root = demo_data[0]
    run = root / "fsdp"
    proc = run_cli(
        "fit",
        *cli_data_args(tiny_dir, demo_data),
        "--trainer.max_steps",
        4,
        "--trainer.val_check_interval",
        4,
        "--trainer.limit_val_batches",
        1,
        "--trainer.num_sanity_val_steps",
        1,
        "--trainer.default_root_dir",
        run,
        "--trainer.callbacks+=tts_lightning.callbacks.SpeakerSamplesCallback",
        "--trainer.callbacks.texts",
        "[" + ", ".join(TEXTS) + "]",
        "--trainer.callbacks.max_new_tokens",
        24,
        "--trainer.callbacks.held_out",
        held_out_manifest,
        # The checkpoint monitors the similarity: all ranks must have logged it, or this fails.
        "--checkpoint.monitor",
        "val/speaker_similarity",
        "--checkpoint.mode",
        "max",
        "--checkpoint.filename",
        "step{step:06d}-sim{val/speaker_similarity:.4f}",
        cwd=root,
        timeout=300,
    )
    return run, proc.stdout + proc.stderr


@pytest.mark.slow
def test_fsdp_fit_with_samples_does_not_deadlock(fsdp_run, tiny_dir, make_datamodule):
    run, output = fsdp_run
    assert "[rank 1] FSDP FULL_SHARD" in output  # really sharded over 2 ranks
    acc = read_events(run)
    check_audio(acc, steps=[4])
    (score,) = acc.Scalars("val/speaker_similarity")  # logged once, the same on both ranks
    assert -1.0 <= score.value <= 1.0
    check_pace_and_baseline(acc, runs=1)
    # The held-out speaker, cloned by rank 0's gathered copy: before training and at the sampled round.
    assert [e.step for e in acc.Audio("zero_shot_samples/dave/0")] == [0, 4]
    (before,) = acc.Scalars("val/zero_shot_similarity_before")
    (now,) = acc.Scalars("val/zero_shot_similarity")
    assert before.step == 0 and -1.0 <= before.value <= 1.0 and -1.0 <= now.value <= 1.0
    checkpoints = [p for p in run.rglob("step*") if "-sim" in p.name]
    assert checkpoints, "ModelCheckpoint did not save on the monitored metric"

    # The samples are those of the weights at that step, gathered from both ranks' shards: a plain
    # model loaded from the checkpoint speaks the very same audio with the same seed.
    from tts_lightning.model.checkpoint import load_training_checkpoint
    from tts_lightning.model.generation import decode_codes, generate_codes
    from tts_lightning.model.loading import build_model
    from tts_lightning.model.pretrained import check_pretrained, load_speech_tokenizer, load_text_tokenizer
    from tts_lightning.model.sequence import tokenize_text

    ckpt = load_training_checkpoint(checkpoints[0])
    info = check_pretrained(tiny_dir)
    model = build_model(info).eval()
    model.load_state_dict(ckpt.model_state_dict())
    data = make_datamodule()
    data.setup("fit")
    table = data.speaker_embeddings()  # the values the run's buffer holds for every speaker it has seen
    tokenizer = load_text_tokenizer(info)
    rows = [(s, i) for s in range(len(SPEAKERS)) for i in range(len(TEXTS))]
    # Each sample is capped at max_new_tokens (24) frames: generated with one token more (the
    # official generation expands all tokens but the last into frames) and cut there.
    codes = generate_codes(
        model,
        [tokenize_text(tokenizer, TEXTS[i]) for _, i in rows],
        torch.stack([table[s] for s, _ in rows]),
        ["english"] * len(rows),
        max_new_tokens=25,
        seed=0,
    )
    codes = [c[:24] for c in codes]
    for (s, i), wav in zip(rows, decode_codes(load_speech_tokenizer(info), codes)):
        logged, _ = sf.read(
            io.BytesIO(acc.Audio(f"samples/{SPEAKERS[s]}/{i}")[0].encoded_audio_string), dtype="float32"
        )
        assert logged.shape == wav.shape
        assert np.abs(logged - np.clip(wav, -1, 1)).max() < 2e-4  # 16-bit quantisation in the event file


@pytest.mark.slow  # 7 generations and their decoding: ~55 s of `make test-fast` under load
def test_predict_writes_24khz_wavs(tiny_dir, make_datamodule, tmp_path):
    data = make_datamodule()
    data.setup("fit")
    module = Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names)
    module.configure_model()
    module.speaker_embeddings.copy_(data.speaker_embeddings())
    texts = ["Hello there.", "Goodbye now.", "One more."]
    # Rank 1 of 2: items 1, 3, 5 of 6 (text x speaker) -> 0000/bob, 0001/bob, 0002/bob.
    dataset = TextsDataset(texts, SPEAKERS, languages="english", num_replicas=2, rank=1)
    # One item on 2 ranks: rank 1 gets a padding repeat, which is generated but not written.
    padded = TextsDataset(["Extra."], ["alice"], ids=["extra"], num_replicas=2, rank=1)
    assert [i["padding"] for i in padded] == [True]
    assert [i["padding"] for i in TextsDataset(["Extra."], ["alice"], num_replicas=2, rank=0)] == [False]
    out = tmp_path / "wavs"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[PredictionWriter(str(out))],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    batches = trainer.predict(
        module,
        dataloaders=[
            DataLoader(dataset, batch_size=2, collate_fn=collate_texts),
            DataLoader(padded, batch_size=2, collate_fn=collate_texts),
        ],
    )
    written = sorted(p.name for p in out.glob("*.wav"))
    assert written == ["0000_bob.wav", "0001_bob.wav", "0002_bob.wav"]  # not the padding row
    predictions = [p for loader in batches for batch in loader for p in batch]
    assert len(predictions) == 4 and predictions[-1]["padding"]
    for p in predictions[:3]:
        wav, sr = sf.read(out / f"{p['id']}_{p['speaker']}.wav")
        assert sr == 24_000 and p["sample_rate"] == 24_000
        assert p["codes"].dim() == 2 and p["codes"].shape[1] == 16 and p["codes"].shape[0] >= 2
        assert len(wav) == len(p["audio"]) == p["codes"].shape[0] * 1920
        assert p["audio"].dtype == np.float32 and np.abs(wav - np.clip(p["audio"], -1, 1)).max() < 1e-3
        assert (out / f"{p['id']}_{p['speaker']}.txt").read_text().strip() == p["text"]

    with pytest.raises(ValueError, match="unknown speaker"):
        module.predict_step({"text": ["Hi."], "speaker": ["carol"]}, 0)
    typo = r"speaker\(s\) 'Bob' \(did you mean 'bob'\?\); this model speaks as alice, bob$"
    with pytest.raises(ValueError, match=typo):
        module.predict_step({"text": ["Hi."], "speaker": ["Bob"]}, 0)
    module.speaker_embeddings[1].zero_()
    with pytest.raises(ValueError, match="no embedding"):
        module.predict_step({"text": ["Hi."], "speaker": ["bob"]}, 0)


@pytest.mark.slow
def test_cli_predict_with_two_fsdp_ranks(run_cli, fsdp_run, tiny_dir, demo_data):
    """`tts-lightning predict` from the sharded checkpoint: both ranks generate in lockstep (rows of
    different lengths), each text x speaker is written once, as the checkpoint speaks it."""
    from predicted_speech import assert_written_by_the_checkpoint, greedy_copy

    run, _ = fsdp_run
    out = run / "wavs"
    texts = ["Hello there.", "How are you today?", "Goodbye."]
    greedy = greedy_copy(tiny_dir, run / "greedy")
    ckpt = next(run.rglob("last.ckpt"))
    run_cli(
        "predict",
        *cli_data_args(greedy, demo_data),
        "--ckpt_path",
        ckpt,
        "--trainer.logger",
        "false",
        "--data.predict_texts",
        "[" + ", ".join(texts) + "]",
        "--trainer.callbacks+=tts_lightning.data.predict.PredictionWriter",
        "--trainer.callbacks.output_dir",
        out,
        cwd=run,
        timeout=300,
    )
    written = sorted(p.name for p in out.glob("*.wav"))
    assert written == [f"{i:04d}_{s}.wav" for i in range(len(texts)) for s in SPEAKERS]
    assert_written_by_the_checkpoint(out, ckpt, greedy, texts, SPEAKERS)


def test_stops_when_similarity_stays_below_the_baseline():
    """The decision uses only the broadcast values, so every rank takes the same one."""
    import contextlib
    from types import SimpleNamespace

    samples = SpeakerSamplesCallback(stop_below_baseline=2)
    samples.load_state_dict({"validation_runs": 3, "baseline_values": {"speaker_similarity": 0.6}})
    trainer = SimpleNamespace(should_stop=False)
    for value, stops in [(0.5, False), (0.7, False), (0.55, False), (0.59, True)]:
        with pytest.warns(UserWarning, match="below the zero-shot baseline") if stops else contextlib.nullcontext():
            samples._check_baseline(trainer, {"speaker_similarity": value})
        assert trainer.should_stop == stops
    assert samples.state_dict()["below_baseline"] == 2
    with pytest.raises(ValueError, match="stop_below_baseline"):
        SpeakerSamplesCallback(stop_below_baseline=0)


@pytest.mark.parametrize("cause", ["resemblyzer missing", "similarity off"])
def test_monitoring_similarity_it_cannot_log_is_refused_before_training(monkeypatch, request, cause):
    """A config that keeps checkpoints by val/speaker_similarity (the GPU configs) without the scorer
    fails at setup, naming the setting and the fix, not after the first validation."""
    import sys

    from lightning.pytorch.callbacks import ModelCheckpoint

    if cause == "resemblyzer missing":
        monkeypatch.setitem(sys.modules, "resemblyzer", None)  # `import resemblyzer` raises ImportError
        similarity_unavailable.cache_clear()  # the answer is cached per process
        request.addfinalizer(similarity_unavailable.cache_clear)
    callback = SpeakerSamplesCallback(similarity=cause != "similarity off")

    def trainer(monitor):
        return L.Trainer(accelerator="cpu", logger=False, callbacks=[ModelCheckpoint(monitor=monitor), callback])

    with pytest.raises(ValueError, match=r"checkpoint\.monitor is val/speaker_similarity, which this run cannot log"):
        callback.setup(trainer("val/speaker_similarity"), None, "fit")
    callback.setup(trainer("val/loss"), None, "fit")  # the loss needs no scorer
    callback.setup(trainer("val/speaker_similarity"), None, "validate")  # nothing is kept by validate


def test_held_out_needs_a_base_model(tiny_dir, tiny_custom_voice_dir, held_out_manifest):
    """A run from a CustomVoice model has no speaker encoder to clone held-out speakers with: refused
    at setup, before training, in one line."""
    module = Qwen3TTSModule(str(tiny_custom_voice_dir), speakers=SPEAKERS)
    samples = SpeakerSamplesCallback(texts=TEXTS, held_out=str(held_out_manifest))
    trainer = L.Trainer(accelerator="cpu", logger=False, callbacks=[samples])
    with pytest.raises(ConfigError, match=r"held_out: .* is a CustomVoice model, .* needs a run from a Base model"):
        samples.setup(trainer, module, "fit")
    # The manifest read as evaluate reads it: a speaker the run trains on is not held out.
    base = Qwen3TTSModule(str(tiny_dir), speakers=[*SPEAKERS, "dave"])
    with pytest.raises(ConfigError, match=r"held_out .*held_out.jsonl: speaker\(s\) \['dave'\] are in the run's data"):
        samples.setup(trainer, base, "fit")


@pytest.mark.slow  # a 2-rank fit
def test_a_failing_sampling_round_is_skipped_and_training_goes_on(tiny_dir, demo_data, run_cli, tmp_path):
    """Sampling fails on rank 0 at every validation: both ranks skip the round together, the run
    finishes its steps and keeps its checkpoints by val/speaker_similarity (NaN for a failed round);
    with on_error raise, it stops instead."""
    demo, manifest, cache = demo_data
    here = Path(__file__).parent
    args = [
        "fit",
        "--config",
        CONFIG,
        "--data.pretrained",
        tiny_dir,
        "--data.train_manifest",
        manifest,
        "--data.cache_dir",
        cache,
        "--data.max_frames_per_batch",
        150,
        "--trainer.max_steps",
        2,
        "--trainer.val_check_interval",
        1,
        "--trainer.default_root_dir",
        tmp_path / "run",
        "--checkpoint.monitor",
        "val/speaker_similarity",
        "--checkpoint.mode",
        "max",
        "--trainer.callbacks+=failing_samples.FailingSamples",
        "--trainer.callbacks.max_new_tokens",
        6,
    ]
    done = run_cli(*args, cwd=tmp_path, pythonpath=[here])
    assert "samples at step 1 failed (RuntimeError: injected decoding failure); skipped" in done.stderr
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert "last.ckpt" in checkpoints and len(checkpoints) == 3, checkpoints  # last + the top 2
    acc = read_events(tmp_path / "run")
    assert [np.isnan(e.value) for e in acc.Scalars("val/speaker_similarity")] == [True, True]
    assert [e.step for e in acc.Scalars("baseline/speaker_similarity")] == [0]  # the baseline worked

    stopped = run_cli(*args, "--trainer.callbacks.on_error", "raise", cwd=tmp_path, pythonpath=[here], check=False)
    assert stopped.returncode != 0 and "injected decoding failure" in stopped.stdout + stopped.stderr


@pytest.mark.parametrize("fail", [False, True], ids=["generated", "generation failed"])
def test_the_generation_copy_is_freed_before_decoding(tiny_dir, make_datamodule, tmp_path, fail):
    """Under FSDP rank 0 generates with a copy of the model gathered from the shards (one process
    here: NO_SHARD, as the 1-GPU configs run); the copy must be gone when the samples are decoded
    and scored (the planner counts the speech tokenizer *instead of* the copy), at the zero-shot
    baseline and after validation, and when generation failed (the round is skipped, training goes
    on). It used to live on in the caller's variable until the round ended."""
    import weakref

    from tts_lightning.distributed.fsdp import Qwen3TTSFSDPStrategy

    class CopyWatch(SpeakerSamplesCallback):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.copies, self.alive_at_decode, self.alive_after_round = [], [], []

        def _generate(self, trainer, pl_module, model, baseline):
            self.copies.append(weakref.ref(model))
            assert model is not pl_module.model  # a gathered copy, not the training model
            if fail:
                raise RuntimeError("injected: generation failed")
            return super()._generate(trainer, pl_module, model, baseline)

        def _log_and_score(self, *args, **kwargs):
            self.alive_at_decode.append(self.copies[-1]() is not None)
            return super()._log_and_score(*args, **kwargs)

        def _sample_collectively(self, *args, **kwargs):
            values = super()._sample_collectively(*args, **kwargs)
            self.alive_after_round.append(self.copies[-1]() is not None)
            return values

    data = make_datamodule()
    watch = CopyWatch(texts=TEXTS[:1], max_new_tokens=4, similarity=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=Qwen3TTSFSDPStrategy(),
        use_distributed_sampler=False,  # the data module shards its own batches
        max_steps=1,
        val_check_interval=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=TensorBoardLogger(str(tmp_path)),
        callbacks=[watch],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names), datamodule=data)
    assert len(watch.copies) == 2  # the baseline at fit start and the round after validation
    assert watch.alive_at_decode == ([] if fail else [False, False])
    assert watch.alive_after_round == [False, False]
    assert trainer.global_step == 1


@pytest.mark.parametrize("adapter", [None, {"rank": 4, "alpha": 8.0}], ids=["full", "lora"])
def test_at_no_shard_the_copy_is_made_from_the_device_parameters(
    tiny_dir, make_datamodule, tmp_path, adapter, monkeypatch
):
    """FSDP1 at world size 1 runs NO_SHARD (the 1-GPU configs): rank 0 holds the full parameters,
    and the generation copy is made from them on the device, not through a full state gathered to
    host memory. It must equal the copy made from that gathered state (LoRA merged), bit for bit,
    and the run must not gather one."""
    import torch.distributed.checkpoint.state_dict as dcp_state
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from tts_lightning.distributed.fsdp import Qwen3TTSFSDPStrategy
    from tts_lightning.model.loading import copy_model

    compared = []

    class Compare(SpeakerSamplesCallback):
        def _generate(self, trainer, pl_module, model, baseline):
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            full = get_model_state_dict(trainer.strategy.model, options=options)
            state = {k[len("model.") :]: v for k, v in full.items() if k.startswith("model.")}
            dtype = next(model.parameters()).dtype
            expected = dict(copy_model(pl_module.model, dtype=dtype, device="cpu", state=state).named_parameters())
            copied = dict(model.named_parameters())
            assert copied.keys() == expected.keys()
            compared.append(all(torch.equal(copied[k], expected[k]) for k in expected))
            raise RuntimeError("compared")  # no need to generate: the round is skipped

    gathered = []

    def watched(*args, **kwargs):  # the real gather, counted (generation_model imports it when called)
        gathered.append(True)
        return get_model_state_dict(*args, **kwargs)

    monkeypatch.setattr(dcp_state, "get_model_state_dict", watched)

    data = make_datamodule()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=Qwen3TTSFSDPStrategy(),
        use_distributed_sampler=False,
        max_steps=1,
        val_check_interval=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=TensorBoardLogger(str(tmp_path)),
        callbacks=[Compare(texts=TEXTS[:1], max_new_tokens=4, similarity=False)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names, adapter=adapter)
    trainer.fit(module, datamodule=data)
    assert compared == [True, True]  # the baseline and the round after the step (weights changed)
    assert gathered == []  # the run itself gathered no full state


def test_a_run_of_many_speakers_samples_a_spread_of_them(tiny_dir):
    """Without `speakers`, at most `max_speakers` (8) are sampled, evenly spaced in the sorted names,
    and it is said (each speaker x text is generated, decoded, drawn and logged every round)."""
    from types import SimpleNamespace

    from tts_lightning.callbacks.speaker_facts import SpeakerFacts

    names = [f"p{i:03d}" for i in range(20)]
    module = Qwen3TTSModule(str(tiny_dir), speakers=names)
    module.speaker_embeddings.fill_(1.0)  # every speaker has an embedding
    said: list[str] = []

    def facts(max_speakers, speakers=None):
        return SpeakerFacts(
            language=None,
            speakers=speakers,
            max_speakers=max_speakers,
            max_new_tokens=24,
            limit_factor=3.0,
            warn=lambda key, message: said.append(message),
        )

    kept, rows = facts(8).speaker_rows(SimpleNamespace(), module)
    assert kept == ["p000", "p002", "p005", "p007", "p010", "p012", "p015", "p017"] and rows.shape[0] == 8
    assert said == [
        "SpeakerSamplesCallback: samples 8 of the run's 20 speakers (p000, p002, p005, p007, p010, p012, p015, "
        "p017): name others with `speakers`, or raise `max_speakers`"
    ]
    assert facts(None).speaker_rows(SimpleNamespace(), module)[0] == names
    # Named speakers the run lacks: refused in one short line, with the name probably meant (the
    # command checks before the ranks start, `setup` on every rank).
    with pytest.raises(ConfigError) as refused:
        SpeakerSamplesCallback(speakers=["p001", "P003", "carol"]).setup(SimpleNamespace(), module, "fit")
    assert str(refused.value) == (
        "SpeakerSamplesCallback: speakers 'P003' (did you mean 'p003'?), 'carol' are not in this run (p000, p001, "
        "p002, p003, p004, p005, p006, p007 and 12 more)"
    )
    with pytest.raises(ValueError, match="max_speakers"):
        SpeakerSamplesCallback(max_speakers=0)
