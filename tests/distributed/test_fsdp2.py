"""`Qwen3TTSFSDP2Strategy` (FSDP2, `fully_shard`) in real `tts-lightning fit` runs with 2 CPU ranks:
the same losses and weights as FSDP1 on the same batches, frozen parameters without gradients,
clipping, checkpoints (full and sharded) and an exact resume after a crash mid-epoch."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from tiny_runs import REFERENCE_EVERY, REFERENCE_STEPS, TINY_CPU, TINY_CPU_FSDP2, data_args, fit_args, scalars

from tts_lightning.data.demo import demo_dir
from tts_lightning.model.checkpoint import load_training_checkpoint
from tts_lightning.model.row_blocks import DEFAULT_TEXT_EMBEDDING_BLOCKS as TEXT_BLOCKS

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
# The uninterrupted runs are `fsdp1_reference` and `fsdp2_full_reference` (conftest.py of this folder,
# shared with test_fit_fsdp.py): 8 steps, checkpoints at steps 4 and 8; the crash loses steps 5-6.
STEPS, EVERY, CRASH = REFERENCE_STEPS, REFERENCE_EVERY, 6


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_dir):
    root = tmp_path_factory.mktemp("fsdp2")
    shutil.copytree(demo_dir(), root / "demo")
    return root


def fit(run_cli, workdir, tiny_dir, run, *extra, check=True):
    record = json.dumps({"class_path": "fsdp2_callbacks.RecordSteps", "init_args": {"out": str(workdir / run)}})
    steps = ("--trainer.max_steps", STEPS, "--trainer.val_check_interval", EVERY)
    args = fit_args(TINY_CPU_FSDP2, workdir, tiny_dir, run, *steps, f"--trainer.callbacks+={record}", *extra)
    return run_cli(*args, cwd=workdir, check=check, pythonpath=[HERE])


def steps(run_dir, rank):
    return json.loads((Path(run_dir) / f"steps-rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def fsdp1_run(fsdp1_reference):
    return fsdp1_reference[0]


@pytest.fixture(scope="module")
def fsdp2_run(fsdp2_full_reference):
    return fsdp2_full_reference


def test_fsdp2_logs_the_metrics_fsdp1_logs(fsdp1_run, fsdp2_run):
    """Sharding must not touch the torchmetrics states (materializing the meta model once wiped
    them: accuracies of 1e14): every accuracy FSDP1 logs, FSDP2 logs with the same value."""
    ref, new = scalars(fsdp1_run), scalars(fsdp2_run[0])
    accuracies = [tag for tag in ref if "acc_codebook" in tag]
    assert "val/acc_codebook_0" in accuracies and "train/acc_codebook_15_step" in accuracies
    for tag in accuracies:
        assert [step for step, _ in new[tag]] == [step for step, _ in ref[tag]], tag
        for (_, value), (_, expected) in zip(new[tag], ref[tag]):
            assert 0.0 <= value <= 1.0 and value == pytest.approx(expected, abs=1e-6), tag


def held_codec_embeddings(tiny_dir, layout) -> set[str]:
    """The codec-embedding modules in the planner's units held through the backward."""
    from tts_lightning.distributed.memory import model_shape

    units = model_shape(tiny_dir, layout=layout).units
    return {p.removesuffix(".weight") for u in units if u.held_in_backward for p, _ in u.params}


def test_fsdp2_trains_like_fsdp1(fsdp1_run, fsdp2_run, tiny_dir):
    run_dir, output = fsdp2_run
    held = re.findall(r"\[rank (\d)\] FSDP2 fully_shard: ([\d,]+) of ([\d,]+) parameters held locally", output)
    assert sorted(r for r, _, _ in held) == ["0", "1"]
    for _, local, total in held:
        assert 0.45 < int(local.replace(",", "")) / int(total.replace(",", "")) < 0.55
    # frozen parameters have no gradient, gradients are DTensor shards, buffers are right (RecordSteps)
    assert len(re.findall(r"\[fsdp2-check\] rank \d: frozen without grads, buffers ok", output)) == 2
    # each row block of the text embedding is a fully_shard unit of its own (RecordSteps)
    units = json.loads((run_dir / "units-rank0.json").read_text())
    text = "model.talker.model.text_embedding"
    assert [u for u in units if u.startswith(text)] == [f"{text}.blocks.{i}" for i in range(TEXT_BLOCKS)]
    for rank in (0, 1):
        ref, new = steps(fsdp1_run, rank), steps(run_dir, rank)
        # The codec embeddings the planner holds through the backward (`Unit.held_in_backward`) are
        # the ones gathered when the talker's last layer gets its gradient (early: the code
        # predictor's backward is done) and still when its first layer does (late).
        for layout, record in (("fsdp1", ref), ("fsdp2", new)):
            held = held_codec_embeddings(tiny_dir, layout)
            for s in record:
                early, late = s["codec_gathered"][0], s["codec_gathered"][-1]
                assert set(early) == held <= set(late), (layout, s)
        assert [s["step"] for s in new] == [s["step"] for s in ref] == list(range(1, STEPS + 1))
        torch.testing.assert_close([s["loss"] for s in new], [s["loss"] for s in ref], atol=1e-5, rtol=1e-5)
        # clipping to gradient_clip_val=1.0 happened (the DTensor clip_grad_norm_), and only when needed
        assert any(s["pre_clip"] > 1.05 for s in new)
        for s in new:
            assert s["post_clip"] == pytest.approx(min(s["pre_clip"], 1.0), rel=1e-4), s
            # each block freed after its own backward (the anchor): at most it and the prefetched
            # next one gathered, not all of them until the end of backward
            assert 1 <= s["gathered_blocks"] <= 2 < TEXT_BLOCKS, s
    ref = load_training_checkpoint(fsdp1_run / "checkpoints" / "last.ckpt")
    new = load_training_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert new.path.is_file() and ref.path.is_dir()  # a full FSDP2 checkpoint, a sharded FSDP1 one
    assert new.global_step == ref.global_step == STEPS
    assert new.state_dict.keys() == ref.state_dict.keys()
    for key, value in ref.state_dict.items():
        torch.testing.assert_close(new.state_dict[key], value, atol=1e-5, rtol=1e-5, msg=key)
    assert not torch.equal(
        new.state_dict["model.talker.codec_head.weight"], _pretrained(new, "talker.codec_head.weight")
    )


def _pretrained(checkpoint, key):
    from tts_lightning.model.pretrained import check_pretrained, load_state_dict

    return load_state_dict(check_pretrained(checkpoint.hyper_parameters["pretrained"]), prefix=key)[key]


@pytest.fixture(scope="module")
def resumed_run(run_cli, workdir, tiny_dir):
    """Killed at step 6 (last sharded checkpoint at step 4), then resumed with `--ckpt_path last`."""
    crash = json.dumps({"class_path": "crash_callbacks.CrashAt", "init_args": {"step": CRASH}})
    crashed = fit(run_cli, workdir, tiny_dir, "resumed", f"--trainer.callbacks+={crash}", check=False)
    assert crashed.returncode != 0 and f"[CrashAt] rank 0 exits at global_step {CRASH}" in crashed.stdout
    last = workdir / "resumed" / "checkpoints" / "last.ckpt"
    assert last.is_dir() and load_training_checkpoint(last).global_step == EVERY
    assert not list(last.parent.glob(".*.partial"))  # written atomically
    resumed = fit(run_cli, workdir, tiny_dir, "resumed", "--ckpt_path", "last")
    assert "Restoring states from the checkpoint path" in resumed.stdout + resumed.stderr
    return workdir / "resumed"


def test_fsdp2_resume_from_sharded_last_equals_uninterrupted(fsdp2_run, resumed_run):
    """The resumed run ends with the weights of the uninterrupted one (which wrote full checkpoints)."""
    straight_dir, _ = fsdp2_run
    assert [s["step"] for s in steps(resumed_run, 0)] == list(range(EVERY + 1, STEPS + 1))
    straight = load_training_checkpoint(straight_dir / "checkpoints" / "last.ckpt")
    resumed = load_training_checkpoint(resumed_run / "checkpoints" / "last.ckpt")
    assert resumed.path.is_dir() and len(list(resumed.path.glob("*.distcp"))) == 2  # DCP, one file per rank
    assert resumed.global_step == straight.global_step == STEPS
    assert straight.state_dict.keys() == resumed.state_dict.keys()
    assert any(k.startswith("model.speaker_encoder.") for k in resumed.state_dict)
    for key, value in straight.state_dict.items():
        torch.testing.assert_close(resumed.state_dict[key], value, atol=1e-6, rtol=1e-5, msg=key)


def test_export_from_sharded_fsdp2_checkpoint_speaks(run_cli, resumed_run, workdir):
    from qwen_tts import Qwen3TTSModel
    from safetensors.torch import load_file

    ckpt = resumed_run / "checkpoints" / "last.ckpt"
    out = workdir / "voice"
    run_cli("export", "--ckpt", ckpt, "--out", out, "--dtype", "fp32", cwd=workdir, timeout=300)
    checkpoint = load_training_checkpoint(ckpt)
    speakers = checkpoint.hyper_parameters["speakers"]
    model = Qwen3TTSModel.from_pretrained(str(out))
    assert set(model.get_supported_speakers()) == set(speakers)
    torch.manual_seed(0)
    wavs, sr = model.generate_custom_voice(text="Hello there.", speaker=speakers[0])
    assert sr == 24_000 and wavs[0].ndim == 1 and wavs[0].size > 0
    exported, weights = load_file(str(out / "model.safetensors")), checkpoint.model_state_dict()
    assert set(exported) == {k for k in weights if not k.startswith("speaker_encoder.")}
    for key, value in exported.items():
        if key != "talker.model.codec_embedding.weight":  # gains the new speakers' rows
            torch.testing.assert_close(value, weights[key], atol=0, rtol=0, msg=key)


def run_args(workdir, tiny_dir, run):
    """`validate` / `predict` of configs/tiny-cpu-fsdp2.yaml on the demo clips, into ``workdir/run``."""
    return ["--config", TINY_CPU_FSDP2, *data_args(workdir, tiny_dir), "--trainer.default_root_dir", workdir / run]


TEXTS = ["Good morning.", "See you soon."]


def test_validate_with_samples_from_a_full_fsdp2_checkpoint(run_cli, fsdp2_run, workdir, tiny_dir, held_out_manifest):
    """`validate` reports the val/loss logged when the checkpoint was saved, and SpeakerSamplesCallback
    speaks with the full weights gathered from both ranks' DTensor shards: the very audio a plain
    model loaded from the checkpoint generates with the same seed."""
    import io

    import numpy as np
    import soundfile as sf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tts_lightning.model.generation import decode_codes, generate_codes
    from tts_lightning.model.loading import build_model
    from tts_lightning.model.pretrained import check_pretrained, load_speech_tokenizer, load_text_tokenizer
    from tts_lightning.model.sequence import tokenize_text

    run_dir, _ = fsdp2_run
    ckpt = next((run_dir / "checkpoints").glob(f"step{EVERY:06d}-val_loss*.ckpt"))
    logged = float(re.search(r"val_loss(\d+\.\d+)", ckpt.name).group(1))
    run_cli(
        "validate",
        *run_args(workdir, tiny_dir, "validate"),
        "--ckpt_path",
        ckpt,
        "--trainer.callbacks+=tts_lightning.callbacks.SpeakerSamplesCallback",
        "--trainer.callbacks.texts",
        "[" + ", ".join(TEXTS) + "]",
        "--trainer.callbacks.max_new_tokens",
        24,
        "--trainer.callbacks.similarity",
        "false",
        "--trainer.callbacks.held_out",  # cloned by the copy gathered from the DTensor shards too
        held_out_manifest,
        cwd=workdir,
        timeout=600,
    )
    events = sorted((workdir / "validate").rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events[0].parent), size_guidance={"audio": 0, "scalars": 0})
    acc.Reload()
    (reported,) = acc.Scalars("val/loss")
    assert abs(reported.value - logged) < 1e-4, (reported.value, logged)
    assert len(acc.Audio("zero_shot_samples/dave/0")) == 1  # validate: the one round, no "before"

    checkpoint = load_training_checkpoint(ckpt)
    speakers = checkpoint.hyper_parameters["speakers"]
    info = check_pretrained(tiny_dir)
    model = build_model(info).eval()
    model.load_state_dict(checkpoint.model_state_dict())
    table = checkpoint.state_dict["speaker_embeddings"]
    tokenizer = load_text_tokenizer(info)
    rows = [(s, i) for s in range(len(speakers)) for i in range(len(TEXTS))]
    codes = generate_codes(  # one token more, cut at max_new_tokens frames, as the callback does
        model,
        [tokenize_text(tokenizer, TEXTS[i]) for _, i in rows],
        torch.stack([table[s] for s, _ in rows]),
        ["english"] * len(rows),
        max_new_tokens=25,
        seed=0,
    )
    for (s, i), wav in zip(rows, decode_codes(load_speech_tokenizer(info), [c[:24] for c in codes])):
        (event,) = acc.Audio(f"samples/{speakers[s]}/{i}")
        heard, sr = sf.read(io.BytesIO(event.encoded_audio_string), dtype="float32")
        assert sr == 24_000 and heard.shape == wav.shape
        assert np.abs(heard - np.clip(wav, -1, 1)).max() < 2e-4  # 16-bit quantisation in the event file


def test_predict_from_a_sharded_fsdp2_checkpoint(run_cli, resumed_run, workdir, tiny_dir):
    """`tts-lightning predict` under FSDP2: both ranks generate in lockstep, each text x speaker is
    written once, as the checkpoint speaks it."""
    from predicted_speech import assert_written_by_the_checkpoint, greedy_copy

    out = workdir / "wavs"
    texts = ["Hello there.", "How are you today?", "Goodbye."]
    greedy = greedy_copy(tiny_dir, workdir / "greedy")
    ckpt = resumed_run / "checkpoints" / "last.ckpt"
    run_cli(
        "predict",
        *run_args(workdir, greedy, "predict"),
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
    speakers = load_training_checkpoint(ckpt).hyper_parameters["speakers"]
    written = sorted(p.name for p in out.glob("*.wav"))
    assert written == sorted(f"{i:04d}_{s}.wav" for i in range(len(texts)) for s in speakers)
    assert_written_by_the_checkpoint(out, ckpt, greedy, texts, speakers)


def test_fsdp1_refuses_an_fsdp2_sharded_checkpoint_on_every_rank(run_cli, resumed_run, workdir, tiny_dir):
    """The reverse of test_fit_fsdp.py's check, where the ranks are started apart (no command-level
    check): FSDP1's strategy refuses FSDP2's sharded checkpoint in one line per rank, status 2."""
    ckpt = resumed_run / "checkpoints" / "last.ckpt"
    args = fit_args(TINY_CPU, workdir, tiny_dir, "fsdp1-from-fsdp2", "--ckpt_path", ckpt)
    proc = run_cli(*args, cwd=workdir, check=False, timeout=300, slurm_job="4244")
    said = (
        f"tts-lightning fit: error: ckpt_path {ckpt} is a sharded checkpoint of FSDP2 (Qwen3TTSFSDP2Strategy), "
        "this run uses FSDP1 (Qwen3TTSFSDPStrategy)"
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (proc.stdout + proc.stderr).count(said) == 2
