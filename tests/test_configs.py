"""Every shipped config (configs/*.yaml, found by glob) is checked against the code's signatures the
way `tts-lightning fit --config` reads it, without building anything that needs weights; its
strategy is constructed on CPU; its commented-out options stay valid; and each GPU config fits the
hardware it states, by the memory planner."""

import re
import sys
from pathlib import Path

import pytest
import yaml

from tts_lightning import cli as cli_module
from tts_lightning.__main__ import main as tts_lightning_main

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted([*(REPO / "configs").glob("*.yaml"), *(REPO / "configs").glob("*.yml")])
GPU_CONFIGS = [
    c
    for c in CONFIGS
    if str(((yaml.safe_load(c.read_text()) or {}).get("trainer") or {}).get("accelerator")) in ("gpu", "cuda")
]
# A GPU config says what it was planned for with the command that checks it, e.g.
#   tts-lightning plan --config configs/qwen3-tts-1.7b-4x16gb.yaml --gpu-memory 16
PLAN_COMMAND = re.compile(r"tts-lightning plan --config (\S+) --gpu-memory (\d+(?:\.\d+)?)\s*$", re.MULTILINE)
# Commented-out options: "# key: value" or "# - item" at the indentation they would have. Keys are
# snake_case: a comment that opens with a capitalised word and a colon ("# FSDP2: ...") is prose.
COMMENTED_OPTION = re.compile(r"^(\s*)# ((?:[a-z_][\w.]*: \S.*)|(?:- [\w.]+\s*))$")


def test_configs_are_found():
    names = {c.name for c in CONFIGS}
    assert {"tiny-cpu.yaml", "qwen3-tts-1.7b-4x16gb.yaml", "qwen3-tts-0.6b-1gpu.yaml"} <= names
    assert {c.name for c in GPU_CONFIGS} >= {
        "qwen3-tts-1.7b-4x16gb.yaml",
        "qwen3-tts-0.6b-1gpu.yaml",
        "qwen3-tts-1.7b-1x24gb.yaml",  # model.optimizer bf16_sr_adamw8bit
        "qwen3-tts-1.7b-1x16gb.yaml",
    }


class _Parsed(Exception):
    def __init__(self, cli):
        self.cli = cli


@pytest.fixture
def parse(monkeypatch):
    """Run the real entry point (`cli_main`, as `tts-lightning fit` does) up to the point where it
    would instantiate the model, data module and trainer, and return the checked config. Parse
    errors end in SystemExit with the message on stderr, as on the command line."""

    def stop(self):  # LightningCLI's public hook, called after parsing and checking, before instantiation
        raise _Parsed(self)

    monkeypatch.setattr(cli_module.TTSLightningCLI, "before_instantiate_classes", stop)
    monkeypatch.setattr(sys, "argv", ["tts-lightning"])

    def run(path, *extra, subcommand="fit"):
        with pytest.raises(_Parsed) as parsed:
            cli_module.cli_main([subcommand, "--config", str(path), *map(str, extra)])
        return parsed.value.cli.config[subcommand]

    return run


def _id(path):
    return path.name


# -- every config against the signatures ------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_config_parses_against_the_signatures(parse, config):
    cfg = parse(config)
    raw = yaml.safe_load(config.read_text())
    assert cfg.data.pretrained == raw["data"]["pretrained"]
    assert cfg.model.pretrained == cfg.data.pretrained  # linked, never stated twice
    assert cfg.data.train_manifest
    for key, value in raw.get("model", {}).items():  # what the YAML says is what the model gets
        if isinstance(value, dict):  # a typed group (model.adapter): every key it sets
            for sub, sub_value in value.items():
                assert cfg.model[key][sub] == sub_value, f"{key}.{sub}"
        else:
            assert cfg.model[key] == value, key
    for key, value in raw["data"].items():
        assert cfg.data[key] == value, key


@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_config_parses_for_validate_too(parse, config):
    parse(config, subcommand="validate")


@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_strategy_resolves_and_constructs_on_cpu(config):
    """The strategy's class path imports, its wrap / checkpointing classes import, and it can be
    constructed from the YAML's init_args (no GPU, no process group needed for that)."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.cli import LightningArgumentParser
    from lightning.pytorch.strategies import FSDPStrategy, Strategy

    from tts_lightning.distributed.fsdp import DEFAULT_CHECKPOINT, DEFAULT_WRAP, Qwen3TTSFSDPStrategy, import_classes

    raw = yaml.safe_load(config.read_text()).get("trainer") or {}
    strategy_cfg = raw.get("strategy", "auto")
    if not isinstance(strategy_cfg, dict):
        pytest.skip(f"strategy {strategy_cfg!r} is a registered name")
    init_args = strategy_cfg.get("init_args") or {}
    for key, default in (("auto_wrap_policy", DEFAULT_WRAP), ("activation_checkpointing_policy", DEFAULT_CHECKPOINT)):
        paths = init_args.get(key)
        if paths is None and strategy_cfg["class_path"].endswith("Qwen3TTSFSDPStrategy"):
            paths = default
        if paths:
            assert import_classes(paths)
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(Trainer, "trainer")
    strategy = parser.instantiate(parser.parse_object({"trainer": {"strategy": strategy_cfg}})).trainer.strategy
    assert isinstance(strategy, Strategy)
    assert type(strategy).__module__ + "." + type(strategy).__qualname__ == strategy_cfg["class_path"]
    if isinstance(strategy, FSDPStrategy):
        assert strategy.sharding_strategy.name == init_args.get("sharding_strategy", "FULL_SHARD")
        if isinstance(strategy, Qwen3TTSFSDPStrategy) and str(raw.get("precision")) == "bf16-mixed":
            assert strategy.mixed_precision_buffers_fp32  # or the MRoPE inv_freq goes bf16


def _uncommented(config) -> list[str]:
    return [COMMENTED_OPTION.sub(r"\1\2", line) for line in config.read_text().splitlines()]


WITH_OPTIONS = [c for c in CONFIGS if _uncommented(c) != c.read_text().splitlines()]


@pytest.mark.parametrize("config", WITH_OPTIONS, ids=_id)
def test_commented_options_are_valid(parse, config, tmp_path):
    """Uncommenting every commented-out option (e.g. `# cpu_offload: true`, `# - talker.model.text_embedding`)
    still gives a valid config, and its strategy still constructs."""
    uncommented = _uncommented(config)
    variant = tmp_path / config.name
    variant.write_text("\n".join(uncommented) + "\n")
    parse(variant)
    test_strategy_resolves_and_constructs_on_cpu(variant)


# -- the checks reject bad configs ------------------------------------------------------------------
BASE = REPO / "configs" / "qwen3-tts-1.7b-4x16gb.yaml"


def _set(cfg: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        cfg = cfg.setdefault(key, {})
    cfg[leaf] = value


@pytest.mark.parametrize(
    "dotted, value, needle",
    [
        # The words that name the key's own problem: the error also echoes every given value.
        ("model.no_such_option", 1, "does not accept option 'model.no_such_option'"),  # unknown key
        ("model.learning_rate", "fast", "Parser key \"model.learning_rate\": Expected a <class 'float'>"),
        ("model.lr_schedule", "exponential", 'Parser key "model.lr_schedule": Expected a typing.Literal'),
        ("data.max_frames_per_batch", "lots", 'Parser key "data.max_frames_per_batch": Does not validate'),
        ("data.train_manfest", "data/train.jsonl", "does not accept option 'data.train_manfest'"),  # misspelt
        ("trainer.max_epoch", 3, "does not accept option 'trainer.max_epoch'"),
        (
            "trainer.strategy.init_args.limit_all_gathers",
            "maybe",
            "Parser key \"limit_all_gathers\": Expected a <class 'bool'>. Got value: maybe",
        ),
        (
            "trainer.strategy.init_args.sharding_strategy",
            "SHARD_ALL",
            'Parser key "sharding_strategy": Expected a typing.Literal',
        ),
        ("trainer.strategy.init_args.no_such_fsdp_option", 1, "Option 'no_such_fsdp_option' is not accepted"),
        ("checkpoint.save_top_k", "two", "Parser key \"checkpoint.save_top_k\": Expected a <class 'int'>"),
    ],
)
def test_bad_config_is_rejected_naming_the_key(parse, capsys, tmp_path, dotted, value, needle):
    cfg = yaml.safe_load(BASE.read_text())
    _set(cfg, dotted, value)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit) as exit_info:
        parse(bad)
    assert exit_info.value.code != 0
    assert needle in capsys.readouterr().err


# -- GPU configs fit the hardware they state --------------------------------------------------------
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=_id)
def test_gpu_config_fits_its_stated_hardware(config, capsys):
    text = config.read_text()
    commands = PLAN_COMMAND.findall(text)
    assert commands, f"{config.name}: state the hardware as a comment `tts-lightning plan --config ... --gpu-memory N`"
    for path, gib in commands:
        assert Path(path).name == config.name, f"{config.name} quotes the plan of {path}"
        assert tts_lightning_main(["plan", "--config", str(config), "--gpu-memory", gib]) == 0
        out = capsys.readouterr().out
        verdict = next(line for line in out.splitlines() if line.startswith("FITS"))
        # The numbers quoted in the config's comments are the planner's, not stale ones.
        assert verdict in text, f"{config.name}: update the quoted plan to {verdict!r}"
        # So are the figures quoted between the command and the verdict (GiB to two decimals, units).
        start = text.index(f"--gpu-memory {gib}")
        quoted = text[start : text.index(verdict, start)]
        for figure in re.findall(r"\b\d+\.\d\d\b|\d+ FSDP2? units", quoted):
            assert figure.replace("FSDP2", "FSDP") in out, f"{config.name}: {figure!r} is not in today's plan:\n{out}"
