"""Export a training checkpoint to a ``custom_voice`` directory that `qwen_tts` speaks with (or, for a
run trained on the ICL layout, to a ``base`` directory: `export_base`).

The released layout, with the new speakers named in ``talker_config.spk_id`` and their fp32
embeddings written into the matching ``codec_embedding`` rows (a custom-voice model looks a speaker
up there and gets exactly the likelihoods the speaker slot had in training). The speaker encoder is
dropped, as in a released CustomVoice model. Written beside its destination and renamed, so a crash
leaves no half export. The weights stream from the checkpoint a tensor at a time (never its
optimizer state), so export needs about one shard of memory, not the checkpoint's size.

A LoRA checkpoint (``hyper_parameters.adapter`` set) holds only the adapters, the extras trained in
full and the speaker table: the other weights are read from the pretrained directory, and each
adapted layer is written merged, ``W + alpha / rank * B @ A`` computed in fp32. `export_adapter`
writes the adapter alone in peft's format instead.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Literal

import torch

from tts_lightning.errors import UserError
from tts_lightning.files import file_in_the_way, replace_directory, save_safetensors, staged_directory
from tts_lightning.model.checkpoint import CheckpointError, CheckpointReader, groups_of_bytes
from tts_lightning.model.custom_voice import new_speaker_ids, speaker_codec_ids
from tts_lightning.model.pretrained import PretrainedInfo, check_pretrained

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}  # config.json's torch_dtype
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
CODEC_EMBEDDING = "model.talker.model.codec_embedding.weight"
DEFAULT_SHARD_BYTES = 2**29  # safetensors shards of 512 MiB: export needs about two of them in memory


class ExportError(UserError, ValueError):
    """The export cannot be written as asked (name clash, bad checkpoint, existing output)."""


def _new_speaker_ids(talker_config: dict, count: int) -> list[int]:
    """Unused codec ids for new speakers (`tts_lightning.model.custom_voice.new_speaker_ids`)."""
    try:
        return new_speaker_ids(talker_config, count)
    except UserError as exc:
        raise ExportError(str(exc)) from None


class _LoRASource:
    """The merged model's tensors, one at a time: pretrained weights, the checkpoint's trainable
    extras, and adapted layers merged with their adapters. Keys are ``model.<hf key>`` like a
    full checkpoint's."""

    def __init__(self, reader: CheckpointReader, info, settings) -> None:
        from safetensors import safe_open

        from tts_lightning.model.loading import WeightReader
        from tts_lightning.model.lora import checkpoint_key, is_adapter_key

        self.reader, self.base, self.scaling = reader, WeightReader(info), settings.scaling
        self.stored = {
            checkpoint_key(k[len("model.") :]): k
            for k in reader.tensor_keys()
            if k.startswith("model.") and not is_adapter_key(k)
        }
        adapters = [k for k in reader.tensor_keys() if ".lora_A." in k]
        self.adapted = {k[len("model.") :].split(".lora_A.")[0] + ".weight": k for k in adapters}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for key, file in self.base.file_of.items():
            with safe_open(str(self.base.path / file), framework="pt") as f:
                self.shapes[key] = tuple(f.get_slice(key).get_shape())
        unknown = sorted(set(self.stored) - set(self.shapes)) + sorted(set(self.adapted) - set(self.shapes))
        if unknown:
            raise CheckpointError(f"{reader.path}: tensors {unknown[:5]} are not in the pretrained weights")

    def keys(self) -> list[str]:
        return ["model." + k for k in self.base.file_of]

    def numel(self, key: str) -> int:
        return int(torch.Size(self.shapes[key[len("model.") :]]).numel())

    def read(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        from tts_lightning.model.lora import merge

        name = key[len("model.") :]
        if name in self.stored:
            value = self.reader.read([self.stored[name]])[self.stored[name]]
        else:
            value = self.base.read(name)
            if name in self.adapted:
                a_key = self.adapted[name]
                b_key = a_key.replace(".lora_A.", ".lora_B.")
                pair = self.reader.read([a_key, b_key])
                value = merge(value, pair[a_key], pair[b_key], self.scaling)
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        return value


class _CheckpointSource:
    """A full fine-tuning checkpoint: every weight is in it."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader

    def keys(self) -> list[str]:
        return [k for k in self.reader.tensor_keys() if k.startswith("model.")]

    def numel(self, key: str) -> int:
        return self.reader.numel(key)

    def read(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        stored = self.reader.dtype(key)
        return self.reader.read([key], dtype=dtype if stored.is_floating_point else None)[key]


def _adapter_settings(hp: dict):
    from tts_lightning.model.lora import LoRASettings

    return LoRASettings.coerce(hp.get("adapter"))


def check_replaceable(out: Path, overwrite: bool) -> None:
    """Refuse to write ``out`` where that would lose something: an existing folder is replaced only
    with ``overwrite`` and only if it is a model folder (a Qwen3-TTS ``config.json``, or a LoRA
    adapter's ``adapter_config.json``: what an export writes); an empty folder is written into."""
    file = file_in_the_way(out)
    if file is not None:
        raise ExportError(f"{out}: {file} is a file, not a folder; choose another --out")
    if not out.exists():
        return
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise ExportError(f"{out} already exists; choose a new folder, or replace that export with --overwrite")
    if (out / "tiny_model.json").is_file():
        raise ExportError(f"{out} is a tiny model (`tts-lightning tiny-model`), not an export: choose a new folder")
    if not _is_model_folder(out):
        names = sorted(p.name for p in out.iterdir())
        held = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise ExportError(
            f"{out} is not a model folder (it holds {held}): --overwrite replaces only an earlier export; "
            "choose a new folder for --out"
        )


def refuse_the_source(out: Path, source: object) -> None:
    """An export never replaces the pretrained model its checkpoint starts from (a local folder)."""
    folder = Path(str(source)).expanduser() if source is not None else None
    if folder is not None and folder.is_dir() and folder.resolve() == out:
        raise ExportError(f"{out} is the pretrained model this checkpoint starts from: choose a new folder for --out")


def _is_model_folder(folder: Path) -> bool:
    if (folder / "adapter_config.json").is_file():
        return True
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type") == "qwen3_tts"
    except (OSError, ValueError, AttributeError):
        return False


def export_custom_voice(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: Literal["bf16", "fp32", "fp16"] = "bf16",
    pretrained: str | os.PathLike | None = None,
    overwrite: bool = False,
    trust_checkpoint: bool = False,
    max_shard_size: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write ``out`` from a full or sharded `Qwen3TTSModule` checkpoint; return its path.

    The weights are streamed: read from the checkpoint a few tensors at a time (never its
    optimizer state), cast, written as safetensors shards of at most ``max_shard_size`` bytes
    (one file when the model fits in one), and freed, so memory stays near one shard.
    """
    out, reader = _open(ckpt, out, dtype, overwrite, trust_checkpoint)
    refuse_the_source(out, pretrained or reader.hyper_parameters.get("pretrained"))
    rows = reader.hyper_parameters.get("speaker_codec_ids")
    if rows is None:  # from a Base model: the speakers' x-vectors become new codec rows
        speakers, embeddings = _speaker_table(reader, ckpt)
        info, config, new_ids = _custom_voice_config(reader, ckpt, pretrained, speakers, dtype)
        speaker_rows = dict(zip(new_ids, embeddings))
    else:  # from a CustomVoice model: the trained rows are in the weights already
        info, config = _kept_voices_config(reader, ckpt, pretrained, [int(r) for r in rows], dtype)
        speaker_rows = {}
    source = _weights(reader, info)
    keys = [k for k in source.keys() if not k.startswith("model.speaker_encoder.")]
    return _write_export(out, info, config, source, keys, dtype, max_shard_size, speaker_rows)


def export_base(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: Literal["bf16", "fp32", "fp16"] = "bf16",
    pretrained: str | os.PathLike | None = None,
    overwrite: bool = False,
    trust_checkpoint: bool = False,
    max_shard_size: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write ``out`` as a ``base`` model (the pretrained config, the trained weights, the speaker
    encoder kept): what an ICL-trained run needs, since only a base model has
    ``generate_voice_clone`` (a reference clip and its transcript in the prompt, as trained). The
    run's speaker table is not written: cloning embeds the reference clip itself. Streamed and
    atomic like `export_custom_voice`."""
    out, reader = _open(ckpt, out, dtype, overwrite, trust_checkpoint)
    source_dir = pretrained or reader.hyper_parameters.get("pretrained")
    refuse_the_source(out, source_dir)
    if source_dir is None:
        raise ExportError(f"{ckpt}: the checkpoint names no pretrained model; pass --pretrained")
    info = check_pretrained(source_dir)
    config = json.loads((info.path / "config.json").read_text())
    if config.get("tts_model_type") != "base":
        raise ExportError(f"{info.path} is a {config.get('tts_model_type')} model: a base export needs a base model")
    config["torch_dtype"] = TORCH_DTYPE_NAMES[dtype]
    source = _weights(reader, info)
    keys = source.keys()
    if not any(k.startswith("model.speaker_encoder.") for k in keys):
        raise ExportError(f"{ckpt}: holds no speaker encoder, which generate_voice_clone needs")
    return _write_export(out, info, config, source, keys, dtype, max_shard_size, speaker_rows={})


def _open(
    ckpt: str | os.PathLike, out: str | os.PathLike, dtype: str, overwrite: bool, trust: bool
) -> tuple[Path, CheckpointReader]:
    """An export's checks before any work: the dtype, the folder it may replace, the checkpoint."""
    out = Path(out).expanduser().resolve()
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_replaceable(out, overwrite)
    return out, CheckpointReader(ckpt, trust=trust)


def _weights(reader: CheckpointReader, info: PretrainedInfo) -> _CheckpointSource | _LoRASource:
    """The checkpoint's weights as the export writes them: a LoRA run's merged into its base."""
    adapter = _adapter_settings(reader.hyper_parameters)
    return _CheckpointSource(reader) if adapter is None else _LoRASource(reader, info, adapter)


def _write_export(
    out: Path,
    info: PretrainedInfo,
    config: dict,
    source: _CheckpointSource | _LoRASource,
    keys: list[str],
    dtype: str,
    max_shard_size: int,
    speaker_rows: dict,
) -> Path:
    """``out``, written atomically: the pretrained folder's other files, ``config``, and the
    ``keys`` of ``source`` cast to ``dtype``, streamed into safetensors shards of at most
    ``max_shard_size`` bytes (one file when they fit in one)."""
    target = DTYPES[dtype]
    itemsize = torch.empty(0, dtype=target).element_size()
    groups = groups_of_bytes(keys, lambda k: source.numel(k) * itemsize, max_shard_size)
    names = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    with staged_directory(out) as tmp:
        _copy_pretrained_files(info.path, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _write_weights(tmp, source, names, groups, target, speaker_rows=speaker_rows)
        replace_directory(tmp, out)
    return out


def trained_layout(ckpt: str | os.PathLike, *, trust_checkpoint: bool = False) -> str:
    """The sequence layout the checkpoint's run trained (``data.layout``): "xvector" when unrecorded,
    or when the checkpoint cannot be read (the export then says why)."""
    try:
        reader = CheckpointReader(ckpt, trust=trust_checkpoint)
    except CheckpointError:
        return "xvector"
    return str((reader.datamodule_hyper_parameters or {}).get("layout") or "xvector")


def _speaker_table(reader: CheckpointReader, ckpt: str | os.PathLike) -> tuple[list[str], torch.Tensor]:
    """The checkpoint's speakers (lower-cased, distinct) and their embeddings (one row each, none zero)."""
    hp = reader.hyper_parameters
    speakers = [str(s).lower() for s in hp.get("speakers") or []]
    if not speakers:
        raise ExportError(f"{ckpt}: the checkpoint names no speakers (hyper_parameters.speakers is empty)")
    if len(set(speakers)) != len(speakers):
        raise ExportError(f"{ckpt}: speaker names clash after lower-casing: {hp.get('speakers')}")
    if "speaker_embeddings" not in reader.tensor_keys():
        raise CheckpointError(f"{ckpt}: speaker_embeddings missing")
    embeddings = reader.read(["speaker_embeddings"])["speaker_embeddings"]
    if embeddings.shape[0] != len(speakers):
        raise CheckpointError(f"{ckpt}: speaker_embeddings has {embeddings.shape[0]} rows for {len(speakers)} speakers")
    unseen = [name for name, row in zip(speakers, embeddings) if row.abs().sum() == 0]
    if unseen:
        raise ExportError(
            f"{ckpt}: speaker(s) {', '.join(unseen)} have no embedding yet (in no training batch before this "
            "checkpoint): resume the run for a step (`fit --ckpt_path`; a run fills them from the prepared data at "
            "its start), or export a later checkpoint"
        )
    return speakers, embeddings


def _custom_voice_config(
    reader: CheckpointReader,
    ckpt: str | os.PathLike,
    pretrained: str | os.PathLike | None,
    speakers: list[str],
    dtype: str,
) -> tuple[PretrainedInfo, dict, list[int]]:
    """The pretrained directory (``pretrained``, else the one the checkpoint names), the exported
    ``config.json`` (a custom_voice model with the new speakers) and the speakers' codec ids."""
    source = pretrained or reader.hyper_parameters.get("pretrained")
    if source is None:
        raise ExportError(f"{ckpt}: the checkpoint names no pretrained model; pass --pretrained")
    info = check_pretrained(source)
    config = json.loads((info.path / "config.json").read_text())
    talker = config["talker_config"]
    existing = {k.lower() for k in (talker.get("spk_id") or {})}
    clashes = sorted(set(speakers) & existing)
    if clashes:
        raise ExportError(f"speaker name(s) {clashes} already exist in {info.path}; rename them")

    new_ids = _new_speaker_ids(talker, len(speakers))
    config["tts_model_type"] = "custom_voice"
    talker["spk_id"] = {**(talker.get("spk_id") or {}), **dict(zip(speakers, new_ids))}
    talker["spk_is_dialect"] = {**(talker.get("spk_is_dialect") or {}), **{s: False for s in speakers}}
    config["torch_dtype"] = TORCH_DTYPE_NAMES[dtype]
    return info, config, new_ids


def _kept_voices_config(
    reader: CheckpointReader, ckpt: str | os.PathLike, pretrained: str | os.PathLike | None, rows: list[int], dtype: str
) -> tuple[PretrainedInfo, dict]:
    """The ``config.json`` of a run from a custom_voice model: its built-in speakers and the run's
    speakers at the codec ids the run trained (``hyper_parameters.speaker_codec_ids``)."""
    speakers = [str(s).lower() for s in reader.hyper_parameters.get("speakers") or []]
    source = pretrained or reader.hyper_parameters.get("pretrained")
    if source is None:
        raise ExportError(f"{ckpt}: the checkpoint names no pretrained model; pass --pretrained")
    info = check_pretrained(source, require_type="custom_voice")
    config = json.loads((info.path / "config.json").read_text())
    talker = config["talker_config"]
    if not speakers or len(rows) != len(speakers) or rows != speaker_codec_ids(talker, speakers):
        raise ExportError(
            f"{ckpt}: its speakers {speakers} do not sit at codec ids {rows} of {info.path}; export with the "
            "custom_voice model the run started from (--pretrained)"
        )
    talker["spk_id"] = {**(talker.get("spk_id") or {}), **dict(zip(speakers, rows))}
    talker["spk_is_dialect"] = {s: False for s in speakers} | (talker.get("spk_is_dialect") or {})
    config["torch_dtype"] = TORCH_DTYPE_NAMES[dtype]
    return info, config


def _copy_pretrained_files(pretrained: Path, tmp: Path) -> None:
    """Everything of the pretrained directory but its weights and config (tokenizers, generation config, ...)."""
    for item in pretrained.iterdir():
        if (
            item.name in WEIGHT_FILES
            or item.name in ("config.json", "tiny_model.json")
            or item.name.startswith("model-")
        ):
            continue
        # Contents only (copyfile): new files as the umask says, not the source's modes (a Hugging
        # Face cache or an older tiny model may hold 0600 files).
        if item.is_dir():
            shutil.copytree(item, tmp / item.name, copy_function=shutil.copyfile)
        else:
            shutil.copyfile(item, tmp / item.name)


def _write_weights(
    tmp: Path,
    source: _CheckpointSource | _LoRASource,
    names: list[str],
    groups: list[list[str]],
    target: torch.dtype,
    *,
    speaker_rows: dict[int, torch.Tensor],
) -> None:
    """The shards ``names`` (one per group of keys), one tensor read at a time, with the new
    speakers' embeddings in their ``codec_embedding`` rows; the index when there are several."""
    weight_map: dict[str, str] = {}
    total = 0
    for name, group in zip(names, groups):
        shard: dict[str, torch.Tensor] = {}
        for key in group:  # one tensor at a time, read straight into the target dtype
            if key == CODEC_EMBEDDING:  # the new speakers' fp32 rows, then the cast
                value = source.read(key).float().clone()
                for row, embedding in speaker_rows.items():
                    value[row] = embedding.float()
                value = value.to(target)
            else:  # read straight into the target dtype (merged in fp32 first for LoRA)
                value = source.read(key, dtype=target)
            value = value.contiguous()
            shard[key[len("model.") :]] = value
            total += value.numel() * value.element_size()
        save_safetensors(shard, tmp / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        del shard
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


ADAPTER_SPEAKERS = "speakers.json"
ADAPTER_EMBEDDINGS = "speaker_embeddings.safetensors"


def export_adapter(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    pretrained: str | os.PathLike | None = None,
    overwrite: bool = False,
    trust_checkpoint: bool = False,
) -> Path:
    """Write the LoRA adapter of a `Qwen3TTSModule` checkpoint in peft's format (``adapter_config.json``
    and ``adapter_model.safetensors``, keys ``base_model.model.<layer>.lora_A.weight``; extras
    trained in full as ``modules_to_save``), plus the speaker table (``speakers.json`` and
    ``speaker_embeddings.safetensors``, fp32): small, for sharing; load it onto the base model
    with ``peft.PeftModel.from_pretrained``. Atomic like `export_custom_voice`."""
    from tts_lightning.model.lora import checkpoint_key, is_adapter_key, lora_config

    out = Path(out).expanduser().resolve()
    check_replaceable(out, overwrite)
    reader = CheckpointReader(ckpt, trust=trust_checkpoint)
    refuse_the_source(out, pretrained or reader.hyper_parameters.get("pretrained"))
    hp = reader.hyper_parameters
    settings = _adapter_settings(hp)
    if settings is None:
        raise ExportError(
            f"{ckpt}: not a LoRA checkpoint (trained without model.adapter); export it without --adapter-only"
        )
    speakers = [str(s).lower() for s in hp.get("speakers") or []]
    embeddings = (
        reader.read(["speaker_embeddings"])["speaker_embeddings"].float()
        if "speaker_embeddings" in reader.tensor_keys()
        else None
    )
    if not speakers or embeddings is None or embeddings.shape[0] != len(speakers):
        raise CheckpointError(f"{ckpt}: the speaker table is missing or does not match hyper_parameters.speakers")
    base = str(pretrained or hp.get("pretrained"))
    model_keys = [k for k in reader.tensor_keys() if k.startswith("model.")]
    targets = sorted({k[len("model.") :].split(".lora_A.")[0] for k in model_keys if ".lora_A." in k})
    extras = sorted(checkpoint_key(k[len("model.") :]) for k in model_keys if not is_adapter_key(k))
    config = lora_config(settings, targets, base_model=base)
    if extras:
        config.modules_to_save = sorted({k.rpartition(".")[0] for k in extras})
    state: dict[str, torch.Tensor] = {}
    values = reader.read(model_keys, dtype=torch.float32)
    for key, value in values.items():
        name = key[len("model.") :]
        if is_adapter_key(name):
            name = name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        else:
            name = checkpoint_key(name)
        state[f"base_model.model.{name}"] = value.contiguous()
    with staged_directory(out) as tmp:
        config.save_pretrained(str(tmp))
        save_safetensors(state, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        save_safetensors(
            {"speaker_embeddings": embeddings.contiguous()}, tmp / ADAPTER_EMBEDDINGS, metadata={"format": "pt"}
        )
        (tmp / ADAPTER_SPEAKERS).write_text(
            json.dumps(
                {
                    "speakers": speakers,
                    "embeddings": ADAPTER_EMBEDDINGS,
                    "base_model": base,
                    "global_step": reader.global_step,
                },
                indent=2,
            )
            + "\n"
        )
        replace_directory(tmp, out)
    return out
