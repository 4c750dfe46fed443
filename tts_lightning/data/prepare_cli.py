"""`tts-lightning prepare`: validate, encode and index a dataset ahead of training.

    tts-lightning prepare --config configs/tiny-cpu.yaml          # the data: section of a fit config
    tts-lightning prepare --data.pretrained DIR --data.train_manifest train.jsonl
    tts-lightning prepare --pretrained DIR --train_manifest train.jsonl --config c.yaml --seed 3

The config may hold ``data: {class_path: ..., init_args: {...}}``, ``data: {init_args: {...}}`` or a
flat ``data: {...}``; other sections (model, trainer, ...) are ignored. Flags override the config.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

DATA_CLASS = "tts_lightning.data.datamodule.SpeakerClipsDataModule"


def _data_section(config_path: str) -> dict[str, Any]:
    import yaml

    path = Path(config_path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a YAML mapping at the top level")
    data = config.get("data")
    if data is None:
        raise ValueError(f"{path}: no data: section")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the data: section must be a mapping")
    if "class_path" in data or "init_args" in data:
        class_path = data.get("class_path")
        if class_path and class_path.rsplit(".", 1)[-1] != "SpeakerClipsDataModule":
            raise ValueError(f"{path}: data.class_path is {class_path!r}, expected {DATA_CLASS}")
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


def prepare_command(argv: list[str]) -> int:
    from jsonargparse import ArgumentParser

    from tts_lightning.data.datamodule import SpeakerClipsDataModule

    parser = ArgumentParser(
        prog="tts-lightning prepare",
        description="Validate the clips, encode their codes and compute the speaker embeddings once, "
        "before training (`fit` does the same, skipping what is already cached).",
    )
    parser.add_argument("--config", type=str, help="a LightningCLI YAML; its data: section is used")
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
        try:
            section = _data_section(config_path)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        unknown = sorted(set(section) - names)
        if unknown:
            print(f"error: {config_path}: unknown data argument(s): {', '.join(unknown)}", file=sys.stderr)
            return 2
        parser.set_defaults({f"data.{k}": v for k, v in section.items()})

    cfg = parser.parse_args(argv)
    kwargs = cfg.data.as_dict() if hasattr(cfg.data, "as_dict") else dict(vars(cfg.data))
    try:
        data = SpeakerClipsDataModule(**kwargs)
        report = data.prepare()
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(report.summary())
    print(f"report: {data.report_path}")
    print(f"prepared: {data.prepared_path} (speakers: {', '.join(data.speaker_names)})")
    return 0


if __name__ == "__main__":
    sys.exit(prepare_command(sys.argv[1:]))
