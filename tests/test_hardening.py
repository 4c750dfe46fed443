"""Failures of the file system, on a real small file system: a full disk or a read-only folder
makes our writers (codec cache, reports, speaker table, staged folders) raise one clear error that
names the path and the free space, leaves no partial file, and a rerun continues.

The file systems are tmpfs mounts of a few pages (the tests run as root, as CI does; without the
right to mount they are skipped)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tts_lightning.files import (
    WriteError,
    atomic_write,
    atomic_write_json,
    replace_directory,
    save_safetensors,
    staged_directory,
)


def _mount(path: Path, size: str, *options: str) -> None:
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(path)],
        check=True,
        capture_output=True,
    )


def _remount(path: Path, *options: str) -> None:
    subprocess.run(["mount", "-o", ",".join(["remount", *options]), str(path)], check=True, capture_output=True)


@pytest.fixture
def small_fs(tmp_path):
    """small_fs(size) -> a folder on a fresh tmpfs of that size, unmounted afterwards."""
    mounts: list[Path] = []

    def make(size: str = "64k") -> Path:
        path = tmp_path / f"fs{len(mounts)}"
        path.mkdir()
        try:
            _mount(path, size)
        except (OSError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {exc}")
        mounts.append(path)
        return path

    yield make
    for path in reversed(mounts):
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def _fill(folder: Path) -> None:
    """Fill the file system of ``folder`` to the last byte."""
    with open(folder / "ballast", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def _leftovers(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".")]


def test_disk_full_names_the_path_and_the_free_space_and_keeps_the_old_file(small_fs):
    fs = small_fs("64k")
    target = atomic_write_json(fs / "report.json", {"old": True})
    _fill(fs)
    with pytest.raises(WriteError) as err:
        atomic_write_json(target, {"new": list(range(5000))})
    message = str(err.value)
    assert err.value.errno == errno.ENOSPC and isinstance(err.value, OSError)
    import tts_lightning

    assert tts_lightning.WriteError is WriteError  # public: `except tts_lightning.WriteError`
    assert str(target) in message and "no space left on device" in message
    assert "0 B free there" in message and "run the same command again" in message
    assert json.loads(target.read_text()) == {"old": True}  # the previous version is intact
    assert _leftovers(fs) == []  # no temporary file left behind

    with pytest.raises(WriteError, match=r"this write needs 1\.0 MiB"):
        atomic_write(fs / "codes.npy", lambda fh: fh.write(b"\1" * (1 << 20)), needed=1 << 20)
    assert not (fs / "codes.npy").exists() and _leftovers(fs) == []

    (fs / "ballast").unlink()  # space again: the same write succeeds
    atomic_write_json(target, {"new": 1})
    assert json.loads(target.read_text()) == {"new": 1}


def test_staged_folder_on_a_full_disk_leaves_nothing(small_fs):
    fs = small_fs("64k")
    out = fs / "voice"
    with pytest.raises(WriteError) as err:
        with staged_directory(out) as tmp:
            (tmp / "config.json").write_text("{}")
            with open(tmp / "model.safetensors", "wb") as fh:
                fh.write(b"\0" * (256 << 10))
            os.replace(tmp, out)
    message = str(err.value)
    assert str(out) in message and "no space left on device" in message and "written before it failed" in message
    assert list(fs.iterdir()) == []  # neither the staged folder nor a partial export


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_and_folders_follow_the_umask(tmp_path, umask):
    # mkstemp and mkdtemp make 0600 files and 0700 folders, safetensors 0600 files: a cache or an
    # export shared with other users (or served by another account) would be unreadable to them.
    import torch

    from tts_lightning.model.export import _copy_pretrained_files

    pretrained = tmp_path / "pretrained"  # files an export copies, private to their owner
    (pretrained / "speech_tokenizer").mkdir(parents=True)
    for private in (pretrained / "vocab.json", pretrained / "speech_tokenizer" / "model.safetensors"):
        private.write_text("{}")
        private.chmod(0o600)
    old = os.umask(umask)
    try:
        report = atomic_write_json(tmp_path / "cache" / "report.json", {})
        for _ in range(2):  # the second replaces the first (`export --overwrite`)
            with staged_directory(tmp_path / "voice") as tmp:
                (tmp / "config.json").write_text("{}")
                save_safetensors({"w": torch.zeros(2)}, tmp / "model.safetensors")
                _copy_pretrained_files(pretrained, tmp)
                replace_directory(tmp, tmp_path / "voice")
    finally:
        os.umask(old)
    assert report.stat().st_mode & 0o777 == 0o666 & ~umask
    assert (tmp_path / "voice").stat().st_mode & 0o777 == 0o777 & ~umask
    for name in ("config.json", "model.safetensors", "vocab.json", "speech_tokenizer/model.safetensors"):
        assert (tmp_path / "voice" / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "pretrained", "voice"]  # nothing set aside


def test_a_replaced_folder_survives_an_interrupted_replacement(tmp_path, monkeypatch):
    """`export --overwrite`: the old export is set aside before the new one moves in (it was deleted
    first) and put back when the move fails or is interrupted."""
    out = tmp_path / "voice"
    out.mkdir()
    (out / "model.safetensors").write_text("old weights")
    rename = os.replace

    def failing(src, dst):
        if Path(dst) == out and Path(src).name != out.name:  # the new one's move, not the old one's return
            raise KeyboardInterrupt
        rename(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(KeyboardInterrupt):
        with staged_directory(out) as tmp:
            (tmp / "model.safetensors").write_text("new weights")
            replace_directory(tmp, out)
    monkeypatch.undo()
    assert (out / "model.safetensors").read_text() == "old weights"
    assert [p.name for p in tmp_path.iterdir()] == ["voice"]  # nothing set aside or staged is left


def test_read_only_folder_is_one_clear_error(small_fs):
    fs = small_fs("64k")
    _remount(fs, "ro")
    with pytest.raises(WriteError) as err:
        atomic_write_json(fs / "cache" / "report.json", {})
    assert err.value.errno == errno.EROFS
    assert f"cannot write {fs / 'cache' / 'report.json'}: read-only file system" in str(err.value)


def test_prepare_on_a_full_disk_stops_clearly_and_a_rerun_continues(small_fs, tiny_dir, tmp_path, capsys):
    """The cache on a 64 KiB file system fills up while encoding: `prepare` fails with one message
    (path, free space, what the rest needs), no partial file; after the disk grows, the same command
    encodes only what is missing."""
    import soundfile as sf

    from tts_lightning.__main__ import main
    from tts_lightning.data.prepare_cli import prepare_command

    lines = []
    (tmp_path / "clips").mkdir()
    t = np.arange(int(0.6 * 24_000)) / 24_000
    for i in range(24):
        sf.write(
            tmp_path / "clips" / f"{i}.wav",
            (0.3 * np.sin(2 * np.pi * (150.0 + 25 * i) * t)).astype(np.float32),
            24_000,
            subtype="PCM_16",
        )
        lines.append(json.dumps({"audio": f"clips/{i}.wav", "text": f"Clip {i}.", "speaker": "ann"}))
    manifest = tmp_path / "train.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    cache = small_fs("64k") / "cache"
    args = ["--pretrained", str(tiny_dir), "--train_manifest", str(manifest), "--cache_dir", str(cache)]

    assert main(["prepare", *args]) == 1  # a refused write: exit status 1, one line
    err = capsys.readouterr().err
    message = next(line for line in err.splitlines() if line.startswith("tts-lightning prepare: error: "))
    assert f"cannot write {cache}" in message and "no space left on device" in message
    assert "free there" in message and "clip(s) still to encode" in message and "run the same command again" in message
    assert _leftovers(cache) == []
    written = sorted(cache.rglob("*.npy"))
    assert 0 < len(written) < 24
    for f in written:  # whatever was written is whole
        assert np.load(f).shape[1] == 16
    stamps = {f: f.stat().st_mtime_ns for f in written}

    _remount(cache.parent, "size=2m")
    assert prepare_command(args) == 0
    assert len(list(cache.rglob("*.npy"))) == 24 and _leftovers(cache) == []
    assert {f: f.stat().st_mtime_ns for f in written} == stamps  # kept, not encoded again
    assert (cache / "prepared.json").is_file()


def test_torch_and_safetensors_writers_on_a_full_disk(small_fs):
    """torch.save (the speaker table) wraps the OSError in a RuntimeError; safetensors (the export)
    raises its own error type: both come out as the same WriteError."""
    import pickle

    import torch
    from safetensors.torch import save_file

    fs = small_fs("64k")
    with pytest.raises(WriteError) as err:
        atomic_write(fs / "speakers" / "table.pt", lambda fh: torch.save({"embeddings": torch.zeros(100_000)}, fh))
    assert err.value.errno == errno.ENOSPC and f"cannot write {fs / 'speakers' / 'table.pt'}" in str(err.value)
    out = fs / "voice"
    with pytest.raises(WriteError) as err:
        with staged_directory(out) as tmp:
            save_file({"w": torch.zeros(100_000)}, str(tmp / "model.safetensors"))
    assert err.value.errno == errno.ENOSPC and f"cannot write {out}: no space left on device" in str(err.value)
    assert _leftovers(fs) == [] and not out.exists()
    again = pickle.loads(pickle.dumps(err.value))  # crosses process boundaries intact
    assert isinstance(again, WriteError) and str(again) == str(err.value)

    with pytest.raises(ValueError):  # other failures pass through unchanged
        atomic_write(fs / "x.json", lambda fh: (_ for _ in ()).throw(ValueError("not a storage problem")))
    assert _leftovers(fs) == []


def test_wav_writers_on_a_full_disk_leave_no_partial_file(small_fs):
    """`predict`'s writer and `evaluate`'s audio go through `atomic_write_wav`: a full disk is one
    WriteError naming the file, and neither a partial .wav nor the temporary file stays (libsndfile
    writing in place left a truncated .wav and raised its own error)."""
    from types import SimpleNamespace

    import soundfile as sf
    import torch

    from tts_lightning.data.predict import PredictionWriter
    from tts_lightning.evaluation.inputs import SpeakerPlan
    from tts_lightning.evaluation.speak import generate_system
    from tts_lightning.files import atomic_write_wav

    fs = small_fs("64k")
    second = np.zeros(24_000, dtype=np.float32)  # 47 KiB as 16-bit PCM
    old = atomic_write_wav(fs / "old.wav", second[:2400], 24_000)
    _fill(fs)
    with pytest.raises(WriteError) as err:
        atomic_write_wav(old, second, 24_000)
    assert str(err.value).startswith(f"cannot write {old}: no space left on device (0 B free there; this write needs ")
    assert sf.info(str(old)).frames == 2400 and _leftovers(fs) == []  # the old file is whole

    writer = PredictionWriter(str(fs / "predictions"))
    item = {"id": "0000", "speaker": "alice", "text": "Hi.", "audio": second, "sample_rate": 24_000}
    with pytest.raises(WriteError, match=r"predictions/0000_alice\.wav: no space left on device"):
        writer.write_on_batch_end(None, None, [item], None, None, 0, 0)
    assert list((fs / "predictions").iterdir()) == []
    roomy = small_fs("32k")  # room for part of the file: the case that left a truncated .wav
    with pytest.raises(WriteError, match=r"0000_alice\.wav: no space left on device \(.*this write needs 46\.9 KiB"):
        PredictionWriter(str(roomy)).write_on_batch_end(None, None, [item], None, None, 0, 0)
    assert list(roomy.iterdir()) == []

    def generate(*args, **kwargs):  # the official generation, as generate_system wraps it
        return [torch.zeros(12, 16)], None

    def generate_custom_voice(**kwargs):
        tts.model.generate()
        return [second], 24_000

    tts = SimpleNamespace(model=SimpleNamespace(generate=generate), generate_custom_voice=generate_custom_voice)
    plan = SpeakerPlan("alice", "english", fs / "ref.wav", None, [], False, ["Hello there."])
    with pytest.raises(WriteError, match=r"fine_tuned/text00_sample0\.wav: no space left on device"):
        generate_system(
            tts,
            "fine_tuned",
            [plan],
            paces={"alice": 0.07},
            num_samples=1,
            seed=0,
            limit_factor=3.0,
            audio_dir=fs / "audio",
        )
    assert [p for p in (fs / "audio").rglob("*") if p.is_file()] == []


def test_synthesize_to_a_full_disk_is_one_message(small_fs, tiny_custom_voice_dir, capsys):
    """The real command on the CPU (the tiny custom_voice model): exit status 1 (the command was
    right; the disk was full), one line, no partial .wav."""
    from tts_lightning.__main__ import main

    fs = small_fs("64k")
    _fill(fs)
    out = fs / "hello.wav"
    args = ["--model", str(tiny_custom_voice_dir), "--speaker", "ryan", "--text", "Hello.", "--max-new-tokens", "8"]
    assert main(["synthesize", *args, "--device", "cpu", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"tts-lightning synthesize: error: cannot write {out}: no space left on device (0 B free there; "
        "this write needs "
    )
    assert err.endswith("and nothing half-written was left\n") and err.count("\n") == 1, err
    assert not out.exists() and _leftovers(fs) == []


@pytest.mark.slow
def test_fit_on_a_full_cache_disk_ends_with_the_error_alone(small_fs, tiny_dir, tmp_path, run_cli):
    """`fit` on 2 FSDP processes whose codec cache fills its disk: each process prints the one-line
    error (no traceback), the run exits 1 and leaves no partial file."""
    import shutil

    from tts_lightning.data.demo import demo_dir

    repo = Path(__file__).resolve().parents[1]
    shutil.copytree(demo_dir(), tmp_path / "demo")
    cache = small_fs("48k") / "cache"
    proc = run_cli(
        "fit",
        "--config",
        repo / "configs" / "tiny-cpu.yaml",
        "--data.pretrained",
        tiny_dir,
        "--data.train_manifest",
        tmp_path / "demo" / "train.jsonl",
        "--data.cache_dir",
        cache,
        "--trainer.max_steps",
        2,
        "--trainer.default_root_dir",
        tmp_path / "run",
        cwd=tmp_path,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tts-lightning fit: error: ")]
    assert errors and all(f"cannot write {cache}" in e and "no space left on device" in e for e in errors)
    assert "Traceback" not in proc.stderr
    assert _leftovers(cache) == []


# A leaked torch.distributed group: tests/conftest.py's autouse _no_leaked_process_group destroys
# the group an in-process test left initialized (a failed assertion before its own cleanup), so the
# next test starts clean. The two tests are a pair: pytest runs a module's tests in file order.
def test_a_test_may_leave_its_process_group_initialized(tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    assert dist.is_initialized() and dist.get_world_size() == 1  # and no destroy_process_group() here


def test_the_next_test_starts_without_it():
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_a_checkpoint_rename_keeps_the_set_aside_one_until_the_new_one_is_in_place(tmp_path):
    """`atomic._rename`: a file replaces a file in one step; a folder is set aside first, and a
    set-aside folder without its final one (a save stopped between the two renames, which
    `--ckpt_path last` resumes from) is kept until the new one is in place."""
    from tts_lightning.distributed.atomic import _rename

    final, partial, old = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.partial", tmp_path / ".last.ckpt.old"
    final.write_text("step 4")
    partial.write_text("step 8")
    _rename(partial, final, old)
    assert final.read_text() == "step 8" and not partial.exists() and not old.exists()

    final.unlink()
    for folder, step in ((old, "step 4"), (partial, "step 8")):  # stopped between the renames, then saved again
        folder.mkdir()
        (folder / "meta.pt").write_text(step)
    _rename(partial, final, old)
    assert (final / "meta.pt").read_text() == "step 8" and not partial.exists() and not old.exists()

    partial.mkdir()
    (partial / "meta.pt").write_text("step 12")
    _rename(partial, final, old)  # an existing folder is set aside, then removed
    assert (final / "meta.pt").read_text() == "step 12" and not old.exists()


def test_a_tool_stopped_by_sigterm_or_ctrl_c_cleans_up_and_says_so(tmp_path, capsys):
    """`tts-lightning <tool>` (export, prepare, ...) under SIGTERM: its cleanup runs (Python's default
    SIGTERM ended the process with the staged folder left behind), one line, status 143; Ctrl-C: 130."""
    import os
    import signal

    from tts_lightning.__main__ import _stoppable
    from tts_lightning.files import staged_directory

    out = tmp_path / "voice"
    before = signal.getsignal(signal.SIGTERM)

    def export_stopped_by(stop) -> int:
        with staged_directory(out) as staged:
            (staged / "model.safetensors").write_bytes(b"half")
            stop()
        return 0

    assert _stoppable("export", lambda: export_stopped_by(lambda: os.kill(os.getpid(), signal.SIGTERM))) == 143
    assert "tts-lightning export: stopped by SIGTERM; what it finished is kept" in capsys.readouterr().err

    def ctrl_c():
        raise KeyboardInterrupt

    assert _stoppable("export", lambda: export_stopped_by(ctrl_c)) == 130
    assert list(tmp_path.iterdir()) == []  # no staged folder left
    assert signal.getsignal(signal.SIGTERM) == before  # put back


def test_an_export_killed_between_its_renames_is_put_back(tmp_path):
    """`files.recover_beside`: after a SIGKILL (no cleanup) the previous export set aside goes back
    where it was, and staging folders are removed; other names are left alone."""
    from tts_lightning.files import recover_beside

    out = tmp_path / "voice"
    (tmp_path / ".voice.old-k3j2h1g0" / "voice").mkdir(parents=True)
    (tmp_path / ".voice.old-k3j2h1g0" / "voice" / "config.json").write_text("{}")
    (tmp_path / ".voice.a8d7f6s5").mkdir()  # a staged, half-written export
    others = [".voice2.a8d7f6s5", ".voice.v2.a8d7f6s5", ".voice.v2.old-a8d7f6s5"]  # other exports' (voice2, voice.v2)
    for other in others:
        (tmp_path / other).mkdir()
    recover_beside(out)
    assert (out / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*others, "voice"])
    (tmp_path / ".voice.q1w2e3r4").mkdir()
    recover_beside(out)  # the export in place stays; the staging folder goes
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*others, "voice"])
