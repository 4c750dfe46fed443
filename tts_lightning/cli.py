"""`tts-lightning fit|validate|test|predict --config ...`: LightningCLI for Qwen3-TTS voice cloning.

The data module owns the pretrained path and the speaker list; the model receives both through
``link_arguments`` so a config never states them twice. The run directory describes itself:
Lightning saves the resolved config as ``config.yaml`` in the logger's folder, beside the TensorBoard
logs (``<default_root_dir>/lightning_logs/version_N``; ``<default_root_dir>`` itself without a
logger), and the checkpoints go to ``<default_root_dir>/checkpoints``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn, cast

from jsonargparse import lazy_instance
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from tts_lightning.callbacks.last_step_checkpoint import LastStepCheckpoint
from tts_lightning.config_yaml import load_yaml_config
from tts_lightning.data.datamodule import SpeakerClipsDataModule
from tts_lightning.distributed.atomic import remove_half_written
from tts_lightning.errors import ConfigError
from tts_lightning.model.module import Qwen3TTSModule
from tts_lightning.resume_path import LAST, REQUEUE_PREFIX, best_checkpoint, check_checkpoint, newest_checkpoint


def _speaker_names(data: SpeakerClipsDataModule) -> list[str]:
    # Before the Trainer starts other processes: a speaker the manifest does not name fails here,
    # once, instead of in prepare_data on one rank while the others wait.
    data.preparer.check_requested_speakers()
    return list(data.speaker_names)


# Where the fit this process runs checkpoints, set as it starts (`before_fit`) and read for the line
# a fit stopped by Ctrl-C or SIGTERM ends with: None while unknown, () with checkpointing off, else
# (its checkpoint folder, its default_root_dir, where SLURM's requeue checkpoints go).
_fit_checkpoints: tuple[str, str] | tuple[()] | None = None


def forget_the_fit() -> None:
    """Before a command's fit: a fit that ran earlier in this process says nothing of this one."""
    global _fit_checkpoints
    _fit_checkpoints = None


def what_a_stopped_fit_kept() -> str:
    """What a fit stopped before its end leaves, and how to go on: a rerun of the same command
    where no checkpoint was written yet (`--ckpt_path last` where one was)."""
    where = _fit_checkpoints
    if where is None or (where and newest_checkpoint(*where) is not None):
        return "the checkpoints written so far are kept: resume with --ckpt_path last"
    if not where:
        return "checkpointing is off: nothing was saved"
    return f"no checkpoint was written yet (in {where[0]}): run the same command again"


def check_callback_speakers(callbacks: Any, speakers: list[str]) -> None:
    """The samples callbacks' speakers against the run's, once before the ranks start (`fit`,
    `validate`, `ray-fit`'s driver); their `setup` checks again on every rank, for runs started
    without this command."""
    from tts_lightning.callbacks.samples import SpeakerSamplesCallback

    for callback in callbacks or []:
        if isinstance(callback, SpeakerSamplesCallback):
            callback.check_speakers(speakers)


def _checkpoint_dir(default_root_dir: str | None) -> str:
    # One stable folder per run directory, not one per logger version, so that
    # `--ckpt_path last` finds the checkpoint an interrupted run left.
    return os.path.join(default_root_dir or "runs", "checkpoints")


class CommandLineParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors are one message, ``tts-lightning fit: error: ...``, and
    where to read the options, instead of jsonargparse's usage of every option (a hundred lines).
    Still ``SystemExit(2)`` with the message on stderr, as before."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        name = parser.prog.split()[-1] if parser.prog else ""
        command = f"tts-lightning {name}" if name in ("fit", "validate", "test", "predict") else "tts-lightning"
        sys.stderr.write(f"{command}: error: {' '.join(message.split())}\n(`{command} --help` lists every option)\n")
        self.exit(2)

    def parse_path(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        """A local ``--config`` file, read first by `load_yaml_config` so that bad YAML names the
        file; URLs (s3://, https://) and missing files as jsonargparse reads and reports them."""
        local = os.fspath(path)
        if os.path.isfile(local):
            try:
                load_yaml_config(local)
            except ConfigError as exc:
                raise TypeError(str(exc)) from None
        return super().parse_path(path, *args, **kwargs)


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, counting optimizer steps (``step 12/60``) across epochs when
    ``max_steps`` bounds the run; per-epoch batches otherwise.

    It shows the training loss (`SHOWN`) as read back on logging steps (``log_every_n_steps``) and
    at epoch end: the module logs it without ``prog_bar``, which would read it back to the host (a
    GPU stall) after every step."""

    SHOWN = ("train/loss_step", "train/loss_epoch")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shown: dict[str, float] = {}
        self._stepped_at = 0

    def _read_shown(self, trainer) -> None:
        if self.is_disabled:
            return
        metrics = trainer.callback_metrics
        self._shown.update({k: float(metrics[k]) for k in self.SHOWN if k in metrics})

    def _by_steps(self) -> bool:
        trainer = self._trainer
        return trainer is not None and trainer.max_steps is not None and trainer.max_steps > 0

    def _get_train_description(self, current_epoch: int) -> str:
        if not self._by_steps():
            return super()._get_train_description(current_epoch)
        description = f"step {self.trainer.global_step}/{self.trainer.max_steps}"
        return f"{description:{len(self.validation_description)}}"

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger's version folder, shown as "v_num: 0.000": not a metric
        return {**metrics, **self._shown}

    def _show_steps(self, trainer) -> None:
        if self.progress is None or self.train_progress_bar_id is None:
            return
        self.progress.update(
            self.train_progress_bar_id,
            total=trainer.max_steps,
            completed=min(trainer.global_step, trainer.max_steps),
            description=self._get_train_description(trainer.current_epoch),
        )

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._read_shown(trainer)
        super().on_train_epoch_end(trainer, pl_module)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self._by_steps() and not self.is_disabled:
            self._show_steps(trainer)
            self.refresh()

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._stepped_at = trainer.global_step  # a resumed run's start is no new step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        # Read the shown loss back once per logged optimizer step, where Lightning logs it: not on
        # the micro-batches that accumulate gradients (the step count has not moved there).
        step, every = trainer.global_step, trainer.log_every_n_steps
        if step != self._stepped_at:
            self._stepped_at = step
            if every and step % every == 0:
                self._read_shown(trainer)
        if not self._by_steps():
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.is_disabled:
            return
        self._show_steps(trainer)
        self._update_metrics(trainer, pl_module)
        self.refresh()


class TTSLightningCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.pretrained", "model.pretrained")
        parser.link_arguments("data", "model.speakers", compute_fn=_speaker_names, apply_on="instantiate")
        # Checkpointing is part of every run and tunable from YAML under `checkpoint:`.
        parser.add_lightning_class_args(LastStepCheckpoint, "checkpoint")  # last.ckpt: the last step
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=_checkpoint_dir)
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/loss",
                "checkpoint.mode": "min",
                "checkpoint.save_last": True,
                "checkpoint.save_top_k": 2,
                "checkpoint.filename": "step{step:06d}-val_loss{val/loss:.4f}",
                "checkpoint.auto_insert_metric_name": False,
                # A save that a resumed run makes again under the same name replaces the interrupted
                # run's file (atomically) instead of keeping it, untracked, beside a "-v1" copy.
                "checkpoint.enable_version_counter": False,
            }
        )

    def _parse_ckpt_path(self) -> None:
        """Lightning's: a checkpoint file's hyper-parameters become the model's config. Checked first
        (a file that is not a checkpoint is one line, not an unpickling error), and read
        memory-mapped: Lightning's reads the whole file, optimizer state included, into memory in
        every process before the run starts."""
        if not self.config.get("subcommand"):
            return
        path = self.config[self.config.subcommand].get("ckpt_path")
        if not path or not Path(path).is_file():
            return
        hparams = check_checkpoint(path)
        hparams.pop("_instantiator", None)
        if hparams:
            if "_class_path" in hparams:
                hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
            self.config = self.parser.parse_object({self.config.subcommand: {"model": hparams}}, self.config)

    def _check_ckpt_path(self) -> None:
        """A ``--ckpt_path`` that names no checkpoint fails here, in the launching process, before
        any other process starts (Lightning would find out on every rank, after the data); ``last``
        is the newest complete checkpoint (`tts_lightning.resume_path`)."""
        path = self.config[self.subcommand].get("ckpt_path")
        if str(path) == "last":
            self._resolve_last()
            return
        if str(path) == "hpc" or path is None:
            self._resolve_requeued(asked=path is not None)
            unresolved = path is None and self.config_init[self.subcommand].get("ckpt_path") is None
            if unresolved and self.subcommand == "fit":
                self.refuse_an_earlier_runs_folder()
            elif unresolved and self.trainer.is_global_zero:  # Lightning's choice, said: no error
                print(
                    f"{self.subcommand}: no --ckpt_path: the weights of data.pretrained as they are "
                    "(--ckpt_path last or best for the run's)"
                )
            return
        if str(path) == "best":
            self._resolve_best()
            return
        if "://" in str(path):
            return
        if self._ranks_read_their_own_storage():
            # Every rank runs this on its own storage: one that stopped here would leave the others
            # waiting for it; the strategies agree on the path across ranks instead
            # (`AtomicCheckpoints.check_on_every_node`).
            return
        if str(path).lower() == "registry" or str(path).lower().startswith("registry:"):
            return
        self._check_checkpoint(path)

    def refuse_an_earlier_runs_folder(self) -> None:
        """A new fit (no ``--ckpt_path``) whose checkpoint folder holds an earlier run's complete
        checkpoint: refused, or its first save would replace that run's ``last.ckpt`` (a rerun of a
        stopped fit's command without ``--ckpt_path last`` lost it). Not checked where the ranks are
        started by torchrun or SLURM (each rank checks its own storage: one that stopped here would
        leave the others waiting); `ray-fit` checks on its driver."""
        if cast(Any, self.trainer) is None:  # ray-fit's driver builds no Trainer: the workers' folder
            dirpath = (self.config.get("checkpoint") or {}).get("dirpath")
        elif self._ranks_read_their_own_storage():
            return
        else:
            dirpath = getattr(self.trainer.checkpoint_callback, "dirpath", None)
        earlier = newest_checkpoint(dirpath) if dirpath else None
        if earlier is not None:
            raise ConfigError(
                f"{dirpath} holds the checkpoints of an earlier run (newest: {earlier.name}): continue it with "
                "--ckpt_path last, or start this run in another --trainer.default_root_dir (or remove that folder)"
            )

    def _ranks_read_their_own_storage(self) -> bool:
        environment = getattr(self.trainer.strategy, "cluster_environment", None)
        return bool(
            environment is not None and environment.creates_processes_externally and self.trainer.world_size > 1
        )

    def _check_checkpoint(self, path: Any) -> None:
        """`check_checkpoint` against this run: its speakers, its adapter, its strategy's sharded
        layout (``SHARDED_PREFIX`` of the project's strategies)."""
        layout = getattr(self.trainer.strategy, "SHARDED_PREFIX", None)
        check_checkpoint(path, self._speakers(), self._adapter(), layout)

    def _adapter(self) -> bool | None:
        """Whether the run's model trains a LoRA adapter (None: no model of this project)."""
        model = getattr(self, "model", None)
        return model.adapter is not None if isinstance(model, Qwen3TTSModule) else None

    def _speakers(self) -> list[str] | None:
        data = getattr(self, "datamodule", None)
        return list(data.speaker_names) if data is not None else None

    def _resolve_last(self) -> None:
        """``--ckpt_path last``: the newest complete checkpoint of the run's folder, said when it is
        not `last.ckpt` (the run stopped while saving). Every rank resolves it on its own storage;
        the strategies resume every rank from global rank 0's choice (`check_on_every_node`)."""
        dirpath = getattr(self.trainer.checkpoint_callback, "dirpath", None)
        newest = newest_checkpoint(dirpath, requeued_in=self.trainer.default_root_dir)
        said = f"ckpt_path last: resuming from {newest}, a later step saved after {LAST} (or {LAST} is missing)"
        self._resume_from(newest, said if newest is not None and newest.name != LAST else None)
        if newest is None and self.subcommand != "fit":  # the untrained model would be used silently
            raise ConfigError(f"ckpt_path last: no checkpoint in {dirpath}: give a checkpoint's path")
        if newest is None:  # said here: Lightning's warning would suggest save_last, which is on
            self.config_init[self.subcommand]["ckpt_path"] = None
            if self.trainer.is_global_zero:
                print(f"ckpt_path last: no checkpoint in {dirpath} yet: starting at step 0")

    def _resolve_best(self) -> None:
        """``--ckpt_path best`` in `validate`, `test` or `predict`: the run's best checkpoint, as its
        newest checkpoint records it (Lightning's ``best`` is the fit's in the same process only).
        Every rank resolves it, on its own storage where ranks are started apart (torchrun, SLURM,
        the processes Lightning starts for ranks > 0): the same file, or the same refusal, where
        they share it; on node-local disks a node without the run's folder refuses alone (torchrun
        then ends the others; elsewhere they wait for it until the process group's timeout)."""
        dirpath = getattr(self.trainer.checkpoint_callback, "dirpath", None)
        best = best_checkpoint(dirpath) if self.subcommand != "fit" else None
        if best is None:
            raise ConfigError(
                f"ckpt_path best: no best checkpoint recorded in {dirpath}"
                + (" (fit resumes with --ckpt_path last)" if self.subcommand == "fit" else "")
                + ": give a checkpoint's path"
            )
        self._check_checkpoint(best)
        if self.trainer.is_global_zero:
            print(f"ckpt_path best: {best}")
        self.config_init[self.subcommand]["ckpt_path"] = str(best)

    def _resume_from(self, newest: Path | None, said: str | None) -> None:
        """The checkpoint a rank resolved on its own storage, checked and given to the fit (said by
        rank 0). The strategy learns whether this rank found one: every rank must agree
        (`AtomicCheckpoints._check_every_rank_resumes`)."""
        if hasattr(self.trainer.strategy, "resolved_resume"):
            self.trainer.strategy.resolved_resume = newest is not None
        if newest is None:
            return
        self._check_checkpoint(newest)
        if said and self.trainer.is_global_zero:
            print(said)
        self.config_init[self.subcommand]["ckpt_path"] = str(newest)

    def _resolve_requeued(self, asked: bool) -> None:
        """A SLURM job without ``--ckpt_path`` whose folder has auto-requeue checkpoints (a requeued
        job: Lightning's rule) resumes from the run's newest complete checkpoint, theirs included
        (a job requeued by a preemption may have a newer `last.ckpt`); ``--ckpt_path hpc`` from the
        newest complete auto-requeue checkpoint. Lightning takes the highest `hpc_ckpt_<n>`, which
        a save the time limit cut short may have taken without finishing."""
        from lightning.fabric.plugins.environments import SLURMEnvironment

        root = Path(self.trainer.default_root_dir)
        if not asked and not SLURMEnvironment.detect():
            return
        if not asked and not (root.is_dir() and any(REQUEUE_PREFIX in p.name for p in root.iterdir())):
            self._resume_from(None, None)  # not a requeued job, here: every rank of a job says so
            return
        dirpath = None if asked else getattr(self.trainer.checkpoint_callback, "dirpath", None)
        newest = newest_checkpoint(dirpath, requeued_in=root)
        self._resume_from(newest, f"resuming this SLURM job from {newest}, the run's newest complete checkpoint")
        if newest is None and not asked:  # half-written ones only: Lightning would resume from a missing path
            remove_half_written(root, REQUEUE_PREFIX)
            if self.trainer.is_global_zero:
                print(f"no complete checkpoint in {root} to resume this SLURM job from: starting at step 0")
        # `hpc` asked for and none found: Lightning says so.

    def _run_subcommand(self, subcommand: str) -> None:
        with warnings.catch_warnings():  # the filters a run adds (`before_fit`) end with it
            super()._run_subcommand(subcommand)

    def before_fit(self) -> None:
        global _fit_checkpoints
        callbacks = self.trainer.checkpoint_callbacks
        ours = [c for c in callbacks if isinstance(c, LastStepCheckpoint)] or callbacks  # `checkpoint:`
        folder = getattr(ours[0], "dirpath", None) if ours else None
        _fit_checkpoints = None  # a folder Lightning names only at setup: unknown
        if not callbacks or folder:
            _fit_checkpoints = (str(folder), str(self.trainer.default_root_dir)) if folder else ()
        self._check_ckpt_path()
        self._check_callbacks()
        self._check_optimizer()
        resumed = self.config_init["fit"].get("ckpt_path")
        if resumed is not None and folder and self._in_the_runs_folders(resumed, folder):
            # Lightning warns of a checkpoint folder with files in it, which a run resumed from its
            # own always has (a new fit there is refused: `refuse_an_earlier_runs_folder`).
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")

    def _in_the_runs_folders(self, path: Any, folder: Any) -> bool:
        """Whether ``path`` is one of the run's own checkpoints: in its checkpoint folder, or a SLURM
        requeue checkpoint in its default_root_dir."""
        if "://" in str(path) or "://" in str(folder):
            return False
        parent = Path(path).expanduser().resolve().parent
        return parent in (Path(folder).expanduser().resolve(), Path(self.trainer.default_root_dir).resolve())

    def _check_optimizer(self) -> None:
        """bf16 weights without stochastic rounding (and the reverse) fail here, before any other
        process starts; `Qwen3TTSModule.configure_model` checks the same on every rank."""
        from tts_lightning.model.optimizers import check_optimizer

        optimizer = getattr(self.model, "optimizer", None)
        if isinstance(optimizer, str):
            check_optimizer(optimizer, str(self.trainer.precision))

    def _check_callbacks(self) -> None:
        speakers = self._speakers()
        if speakers is not None:
            check_callback_speakers(cast(Any, self.trainer).callbacks, speakers)

    def before_validate(self) -> None:
        self._check_ckpt_path()
        self._check_callbacks()

    def before_test(self) -> None:
        self._check_ckpt_path()

    def before_predict(self) -> None:
        self._check_ckpt_path()

    def after_fit(self) -> None:
        """Say where the run's files went (rank 0 only; nothing collective here)."""
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        log_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
        ckpt = trainer.checkpoint_callback
        if isinstance(ckpt, ModelCheckpoint) and ckpt.dirpath:
            paths = [
                f"last: {ckpt.last_model_path}" if ckpt.last_model_path else "",
                f"best: {ckpt.best_model_path}" if ckpt.best_model_path else "",
            ]
            saved = "; ".join(s for s in paths if s) or "none written"
            print(f"checkpoints: {ckpt.dirpath} ({saved})")
        elif not trainer.checkpoint_callbacks:
            print("checkpoints: none (checkpointing is off)")
        if log_dir:
            print(f"logs: {log_dir}")

    def instantiate_trainer(self, **kwargs: Any):
        """The trainer, with the `checkpoint:` ModelCheckpoint only while checkpointing is on:
        ``--trainer.enable_checkpointing false`` turns it off (Lightning refuses a ModelCheckpoint
        callback when checkpointing is disabled), and the default `LearningRateMonitor` only with
        a logger (Lightning refuses it with ``--trainer.logger false``: nothing to write to)."""
        trainer_config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        keys = self._parser(self.subcommand).callback_keys
        if trainer_config.get("enable_checkpointing") is False:
            keys = [k for k in keys if k != "checkpoint"]
        if trainer_config.get("logger") is False:  # the defaults are appended to the config's callbacks
            defaults = self.trainer_defaults.get("callbacks") or []
            kept = [c for c in defaults if not isinstance(c, LearningRateMonitor)]
            self.trainer_defaults = {**self.trainer_defaults, "callbacks": kept}
        return self._instantiate_trainer(trainer_config, [self._get(self.config_init, k) for k in keys])


def trainer_defaults() -> dict[str, Any]:
    """The default callbacks; and ``use_distributed_sampler: False``, since `SpeakerClipsDataModule`
    deals its length-bucketed batches to the ranks itself (it refuses a run of several processes
    with the flag on). No logger here: Lightning's default writes TensorBoard logs into
    ``<default_root_dir>/lightning_logs``, so they follow the run's folder like its checkpoints."""
    return {
        "default_root_dir": "runs",
        "use_distributed_sampler": False,
        "callbacks": [
            lazy_instance(LearningRateMonitor, logging_interval="step"),
            lazy_instance(StepProgressBar),  # "step 12/60" when max_steps bounds the run
        ],
    }


def cli_main(
    args: list[str] | None = None, *, run: bool = True, cli_class: type[TTSLightningCLI] = TTSLightningCLI
) -> TTSLightningCLI:
    """The CLI every entry point builds (`fit` and friends, `ray-fit` workers, config tests)."""
    from tts_lightning import console

    console.install()  # also in processes that do not start from `tts-lightning` (Ray workers)
    return cli_class(
        Qwen3TTSModule,
        SpeakerClipsDataModule,
        trainer_defaults=trainer_defaults(),
        save_config_kwargs={"overwrite": True},
        parser_class=CommandLineParser,
        args=args,
        run=run,
    )
