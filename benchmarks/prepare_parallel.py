"""Parallel prepare: wall time of preparing ~10 minutes of audio with 1 versus 2 processes.

A dataset of about 10 minutes is made from the demo clips (each of the 24 clips at 10 gains, so
every file has its own content: 240 clips, ~632 s). The same script then runs twice, each time in
fresh processes on a fresh cache: a Lightning `Trainer` with 1 process, then with 2 (DDP on CPU,
gloo), fitting a do-nothing module for one step so that Lightning runs ``prepare_data`` and
``setup``. With 2 processes ``prepare_data`` reads the manifest on rank 0 and ``setup`` splits the
file checks of validation, the codec encoding and the speaker embeddings over both ranks. The time
reported is rank 0's wall time from the start of ``prepare_data`` to the end of ``setup``
(validation, encoding, speaker embeddings, index; both ranks done), so process start-up is not
counted in either, nor is importing qwen_tts (~1 s), which a real run's `Qwen3TTSModule` has done
(reading the config) before ``prepare_data``. Also checks that both caches hold the same bytes
(every file: codes, speaker table, index, report, validation memo; but the memo of file
fingerprints, whose entries are in the order the processes wrote them). Target: 2 processes / 1 process <= 0.6.
The pair of runs is repeated (``--repeats``, alternating 1 and 2 processes) and the median ratio
reported: one process's time alone varies by 10-30% from run to run on a shared 2-core machine.

Beside each pair, how the machine scales the work prepare mostly is: the speech tokenizer alone
encoding the same clips (loaded and resampled beforehand, batches of the default size), all of them
in 1 process, then half each in 2 processes started together. On a 2-core VM whose cores share a
cache and memory bandwidth, the tiny codec's memory-bound layers (ELU, copies) need not run twice as
fast on two cores, and prepare's ratio can hardly be better than this one.

``--codec mimi`` swaps the tiny speech tokenizer for one whose encoder has Mimi's default sizes (64
filters, hidden size 512, 8 transformer layers; random weights): the 12 Hz tokenizer's encoder is
Mimi's, so this is about the released encoder's compute per second of audio (its config is not on
this machine), where the tiny one is memory-bound. The rest of the model stays tiny (prepare uses
only its speaker encoder). Use fewer ``--gains`` with it: it encodes about 5x slower than real time
on one core.

    python benchmarks/prepare_parallel.py [--gains 10] [--repeats 3] [--codec tiny|mimi]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import resource, sys, time
import lightning as L
import torch
import qwen_tts  # a real run's Qwen3TTSModule imported it (reading the config) before prepare_data
from tts_lightning.data.datamodule import SpeakerClipsDataModule

class Timed(SpeakerClipsDataModule):
    start = None
    def prepare_data(self):
        Timed.start = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        super().prepare_data()
    def setup(self, stage=None):
        if Timed.start is None:
            Timed.start = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        super().setup(stage)
        if self.trainer.global_rank == 0:
            (start, before), after = Timed.start, resource.getrusage(resource.RUSAGE_SELF)
            print(f"PREPARE_SECONDS {time.perf_counter() - start:.3f} SYSTEM {after.ru_stime - before.ru_stime:.3f} "
                  f"FAULTS {after.ru_minflt - before.ru_minflt}", flush=True)

class Nothing(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
    def training_step(self, batch, batch_idx):
        return self.w * batch.codes.float().mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

pretrained, manifest, cache, devices = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
data = Timed(pretrained, manifest, cache_dir=cache, max_frames_per_batch=400, val_fraction=0.0)
L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=1,
          logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
          num_sanity_val_steps=0, use_distributed_sampler=False).fit(Nothing(), data)
"""

# The encoding alone, in forked processes that start together (a barrier) on their shares, dealt as
# the ranks of prepare deal theirs; the time is from the start to the last process's end.
ENCODE_SCRIPT = """
import json, multiprocessing, sys, time
from tts_lightning.data.audio import load_audio
from tts_lightning.data.codec_cache import pad_to_frames
from tts_lightning.data.prepare import PrepareSettings
from tts_lightning.model.pretrained import check_pretrained, load_speech_tokenizer

pretrained, manifest, processes = sys.argv[1], sys.argv[2], int(sys.argv[3])
batch = PrepareSettings.encode_batch_size
tokenizer = load_speech_tokenizer(check_pretrained(pretrained))
with open(manifest, encoding="utf-8") as lines:
    waves = sorted((pad_to_frames(load_audio(json.loads(line)["audio"]).numpy()) for line in lines), key=len)

def encode(share, barrier, out):
    barrier.wait()
    start = time.monotonic()
    for i in range(0, len(share), batch):
        tokenizer.encode(share[i : i + batch], sr=24000)
    out.put((start, time.monotonic()))

fork = multiprocessing.get_context("fork")
barrier, out = fork.Barrier(processes), fork.Queue()
workers = [fork.Process(target=encode, args=(waves[r::processes], barrier, out)) for r in range(processes)]
for w in workers:
    w.start()
spans = [out.get() for _ in workers]
for w in workers:
    w.join()
print(f"ENCODE_SECONDS {max(end for _, end in spans) - min(start for start, _ in spans):.3f}", flush=True)
"""


# Mimi's default encoder sizes (transformers' MimiConfig), over the tiny encoder's.
MIMI_ENCODER = {
    "hidden_size": 512,
    "num_filters": 64,
    "num_hidden_layers": 8,
    "intermediate_size": 2048,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
}


def with_mimi_encoder(tiny: Path, out: Path) -> Path:
    """A copy of the tiny directory whose speech tokenizer's encoder has `MIMI_ENCODER`'s sizes
    (random weights, initialised as the tiny builder does; codebooks and decoder unchanged)."""
    import json

    import torch
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model
    from safetensors.torch import save_file

    from tts_lightning.model.tiny import _fan_in_init, _init_speech_tokenizer

    shutil.copytree(tiny, out)
    folder = out / "speech_tokenizer"
    config_dict = json.loads((folder / "config.json").read_text())
    config_dict["encoder_config"].update(MIMI_ENCODER)
    config = Qwen3TTSTokenizerV2Config(**{k: v for k, v in config_dict.items() if k != "model_type"})
    generator = torch.Generator().manual_seed(0)
    model = Qwen3TTSTokenizerV2Model(config)
    _fan_in_init(model, generator)
    _init_speech_tokenizer(model, generator)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config_dict, indent=2))
    return out


def make_dataset(root: Path, gains: int) -> tuple[Path, float]:
    import json

    import soundfile as sf

    from tts_lightning.data.demo import demo_dir
    from tts_lightning.data.manifest import load_manifest

    lines, seconds = [], 0.0
    for record in load_manifest(demo_dir() / "train.jsonl").records:
        wave, sr = sf.read(record.audio, dtype="float32")
        for g in range(gains):
            out = root / "clips" / record.speaker / f"{record.audio.stem}_g{g}.wav"
            out.parent.mkdir(parents=True, exist_ok=True)
            sf.write(out, wave * (1.0 - 0.05 * g), sr, subtype="PCM_16")
            seconds += len(wave) / sr
            lines.append(json.dumps({"audio": str(out), "text": record.text, "speaker": record.speaker}))
    manifest = root / "train.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest, seconds


@dataclass
class Timing:
    """Rank 0 of one prepare run, from ``prepare_data`` to the end of ``setup``: wall seconds, system
    CPU seconds and minor page faults."""

    seconds: float
    system: float
    faults: int


def _launch(script: Path, args: list[object], pattern: str, what: str, env: dict[str, str] | None = None) -> re.Match:
    """Run ``script`` with ``args`` in a fresh interpreter (one thread, this checkout importable,
    ``env`` added) and return the match of ``pattern`` in its output; stop naming ``what`` when
    it fails or prints no such line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        cwd=script.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    out = proc.stdout + proc.stderr
    found = re.search(pattern, out)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{out[-4000:]}")
    return found


def run(
    tiny: Path, manifest: Path, cache: Path, devices: int, script: Path, env: dict[str, str] | None = None
) -> Timing:
    """Prepare in fresh processes (``devices`` of them); ``env``: more environment variables."""
    pattern = r"PREPARE_SECONDS ([0-9.]+) SYSTEM ([0-9.]+) FAULTS ([0-9]+)"
    found = _launch(script, [tiny, manifest, cache, devices], pattern, f"prepare in {devices} process(es)", env)
    return Timing(float(found.group(1)), float(found.group(2)), int(found.group(3)))


def encode_alone(tiny: Path, manifest: Path, processes: int, script: Path) -> float:
    """Seconds for the speech tokenizer alone to encode the manifest's clips in ``processes``
    forked processes that start together (ENCODE_SCRIPT)."""
    found = _launch(
        script, [tiny, manifest, processes], r"ENCODE_SECONDS ([0-9.]+)", f"encoding alone in {processes} process(es)"
    )
    return float(found.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gains", type=int, default=10, help="copies of each demo clip (10: ~632 s of audio)")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (1 process, then 2), fresh caches")
    parser.add_argument(
        "--codec", choices=["tiny", "mimi"], default="tiny", help="the speech tokenizer's encoder sizes"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from tts_lightning.model.tiny import build_tiny_pretrained

    with tempfile.TemporaryDirectory(prefix="tts-bench-") as tmp:
        root = Path(tmp)
        tiny = build_tiny_pretrained(root / "tiny", seed=0)
        if args.codec == "mimi":
            tiny = with_mimi_encoder(tiny, root / "mimi")
        manifest, seconds = make_dataset(root / "data", args.gains)
        script = root / "prepare_run.py"
        script.write_text(SCRIPT)
        encode_script = root / "encode_run.py"
        encode_script.write_text(ENCODE_SCRIPT)

        def files(cache: Path) -> dict[str, bytes]:
            paths = [p for p in cache.rglob("*") if p.is_file() and p.name != "fingerprints.json"]
            return {p.relative_to(cache).as_posix(): p.read_bytes() for p in paths}

        pairs, encode_pairs, same = [], [], True
        for i in range(args.repeats):
            one = run(tiny, manifest, root / f"cache1-{i}", 1, script).seconds
            two = run(tiny, manifest, root / f"cache2-{i}", 2, script).seconds
            pairs.append((one, two))
            encode_pairs.append(
                (encode_alone(tiny, manifest, 1, encode_script), encode_alone(tiny, manifest, 2, encode_script))
            )
            one_files, two_files = files(root / f"cache1-{i}"), files(root / f"cache2-{i}")
            same &= one_files == two_files and len([p for p in one_files if p.endswith(".npy")]) == args.gains * 24
            shutil.rmtree(root / f"cache1-{i}")
            shutil.rmtree(root / f"cache2-{i}")
        shutil.rmtree(root / "data")
    ratio = statistics.median(two / one for one, two in pairs)
    ceiling = statistics.median(two / one for one, two in encode_pairs)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"audio: {args.gains * 24} clips, {seconds:.0f} s ({seconds / 60:.1f} min), tiny model, "
        f"{args.codec} codec encoder, "
        f"{os.cpu_count()} CPU cores (load average {load}: other work on the machine slows the 2 processes)"
    )
    print(f"prepare, 1 process:   {', '.join(f'{one:.1f}' for one, _ in pairs)} s")
    print(f"prepare, 2 processes: {', '.join(f'{two:.1f}' for _, two in pairs)} s")
    print(f"ratio 2/1 per pair:   {', '.join(f'{two / one:.2f}' for one, two in pairs)}")
    print(f"same cache bytes (codes, speaker table, index, report, validation memo): {'yes' if same else 'NO'}")
    print(f"ratio 2/1, median:    {ratio:.2f} (target <= 0.6: {'met' if ratio <= 0.6 else 'NOT met'})")
    print(f"encoding alone, 1 process:   {', '.join(f'{one:.1f}' for one, _ in encode_pairs)} s")
    print(f"encoding alone, 2 processes: {', '.join(f'{two:.1f}' for _, two in encode_pairs)} s")
    print(f"encoding alone, ratio 2/1 per pair: {', '.join(f'{two / one:.2f}' for one, two in encode_pairs)}")
    print(
        f"encoding alone, ratio 2/1, median: {ceiling:.2f} (how this machine scales the encoding); "
        f"prepare / that: {ratio / ceiling:.2f}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
