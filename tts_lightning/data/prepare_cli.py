"""`tts-lightning prepare`: validate, encode and index a dataset ahead of training.

    tts-lightning prepare --config configs/tiny-cpu.yaml          # the data: section of a fit config
    tts-lightning prepare --data.pretrained DIR --data.train_manifest train.jsonl
    tts-lightning prepare --pretrained DIR --train_manifest train.jsonl --config c.yaml --seed 3
    tts-lightning prepare --config configs/tiny-cpu.yaml --verify # also read every cached file back

The config may hold ``data: {class_path: ..., init_args: {...}}``, ``data: {init_args: {...}}`` or a
flat ``data: {...}``; other sections (model, trainer, ...) are ignored. Flags override the config.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from tts_lightning.names import some_names

DATA_CLASS = "tts_lightning.data.datamodule.SpeakerClipsDataModule"


def data_section(config_path: str | Path) -> dict[str, Any]:
    """The ``data:`` section of a LightningCLI YAML (its ``init_args`` when it has a class path);
    a missing file, bad YAML or a section of another class is a `ConfigError` naming the file."""
    from tts_lightning.config_yaml import load_yaml_config
    from tts_lightning.errors import ConfigError

    path = Path(config_path)
    config = load_yaml_config(path) or {}
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a YAML mapping at the top level")
    data = config.get("data")
    if data is None:
        raise ConfigError(f"{path}: no data: section")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the data: section must be a mapping")
    if "class_path" in data or "init_args" in data:
        class_path = data.get("class_path")
        if class_path and class_path.rsplit(".", 1)[-1] != "SpeakerClipsDataModule":
            raise ConfigError(f"{path}: data.class_path is {class_path!r}, expected {DATA_CLASS}")
        data = data.get("init_args") or {}
    return dict(data)


def _qualify_flags(argv: list[str], names: set[str]) -> list[str]:
    """``--train_manifest X`` -> ``--data.train_manifest X`` for the data module's arguments."""
    out = []
    for arg in argv:
        if arg.startswith("--") and not arg.startswith("--data."):
            name, eq, value = arg[2:].partition("=")
            if name in names:
                arg = f"--data.{name}{eq}{value}"
        out.append(arg)
    return out


def _verify_cache(data) -> tuple[int, int]:
    """Read back every codes file of the data module's cache (header, size, shape, dtype, codebook
    range); remove the bad ones (a warning names each) so that `prepare` encodes them again."""
    from tts_lightning.data.codec_cache import CodecCache

    settings = data.settings
    cache = CodecCache(
        data.cache_dir, data.pretrained_info, normalize=settings.normalize, trim_silence=settings.trim_silence
    )
    names: dict[str, str] = {}
    try:  # name the clip of each file, from the last index, when there is one
        names = {e["codes"]: e["audio"] for e in json.loads(data.prepared_path.read_text(encoding="utf-8"))["clips"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    checked, removed = cache.verify_all(full=True, names=names)
    return checked, len(removed)


def _remaining_need(data, exc) -> str | None:
    """What the codes still to encode need, estimated from the data report (written before
    encoding) and the codes already cached; None when unknown."""
    try:
        report = json.loads(data.report_path.read_text(encoding="utf-8"))
        clips, seconds = int(report["accepted"]), float(report["total_accepted_seconds"])
        info = data.pretrained_info
        from tts_lightning.data.codec_cache import CodecCache

        folder = CodecCache(data.cache_dir, info).cache_dir / "codes"
        cached = sum(1 for _ in folder.rglob("*.npy")) if folder.is_dir() else 0
        block = os.statvfs(exc.path.parent if exc.path.parent.exists() else data.cache_dir).f_frsize or 4096
    except (OSError, ValueError, KeyError, TypeError):
        return None
    todo = max(0, clips - cached)
    if not clips or not todo:
        return None
    groups = info.num_code_groups
    per_clip = 128 + (seconds * 12.5 / clips + 1) * groups * 2  # .npy header + int16 codes
    per_clip = math.ceil(per_clip / block) * block
    from tts_lightning.files import format_bytes

    return f"about {todo} clip(s) still to encode, about {format_bytes(todo * per_clip)} of codes"


def prepare_command(argv: list[str]) -> int:
    from jsonargparse import ArgumentParser

    from tts_lightning.data.datamodule import SpeakerClipsDataModule
    from tts_lightning.errors import ConfigError

    parser = ArgumentParser(
        prog="tts-lightning prepare",
        description="Validate the clips, encode their codes and compute the speaker embeddings once, "
        "before training (`fit` does the same, skipping what is already cached).",
    )
    parser.add_argument("--config", type=str, help="a LightningCLI YAML; its data: section is used")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="read back every cached codes file (shape, dtype, codebook range) and encode the bad ones again",
    )
    parser.add_argument(
        "--ray.num_workers",
        type=int,
        default=0,
        help="encode the codes on this many Ray Data workers (0: in this process); needs the ray extra",
    )
    parser.add_argument(
        "--ray.address",
        type=str,
        default="local",
        help="'local' starts Ray on this machine; 'auto' or an address joins a cluster",
    )
    parser.add_class_arguments(SpeakerClipsDataModule, "data")
    names = set(inspect.signature(SpeakerClipsDataModule.__init__).parameters) - {"self"}
    argv = _qualify_flags(list(argv), names)

    # Read --config first, so its values become defaults that flags then override.
    config_path = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            config_path = argv[i + 1]
        elif arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
    if config_path is not None:
        section = data_section(config_path)
        unknown = sorted(set(section) - names)
        if unknown:
            raise ConfigError(f"{config_path}: unknown data argument(s): {', '.join(unknown)}")
        parser.set_defaults({f"data.{k}": v for k, v in section.items()})

    cfg = parser.parse_args(argv)
    kwargs = cfg.data.as_dict() if hasattr(cfg.data, "as_dict") else dict(vars(cfg.data))
    from tts_lightning.files import WriteError

    data = None
    try:
        data = SpeakerClipsDataModule(**kwargs)
        if cfg.verify:
            checked, bad = _verify_cache(data)
        # The summary is printed below, once: not logged by prepare as well.
        report = data.prepare(ray_workers=cfg.ray.num_workers, ray_address=cfg.ray.address, show_report=False)
    except WriteError as exc:
        # `report_errors` prints it (exit status 1); a full disk also says what the rest needs.
        rest = _remaining_need(data, exc) if exc.disk_full and data is not None else None
        if rest:
            raise exc.with_remaining(rest) from exc
        raise
    if cfg.verify and not checked:
        print("verify: nothing was cached before this prepare")
    elif cfg.verify:
        print(f"verified {checked} cached codes file(s): {bad} bad" + (", encoded again" if bad else ""))
    print(report.summary())
    print(f"report: {data.report_path}")
    speakers = data.speaker_names
    count = f"{len(speakers)} speaker" + ("s" if len(speakers) != 1 else "")
    print(f"prepared: {data.prepared_path} ({count}: {some_names(speakers)})")
    return 0


if __name__ == "__main__":
    from tts_lightning.errors import report_errors

    sys.exit(report_errors("prepare", lambda: prepare_command(sys.argv[1:])))
