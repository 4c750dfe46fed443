"""report.json, written at every prepare and shown once: a user reads it when it is new, not on every run."""

from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_info

from tts_lightning.data.validation import ValidationReport


class ReportLog:
    """Writes report.json and shows the report, once per instance (e.g. ``data.prepare()`` and
    then ``trainer.fit``, whose ``prepare_data`` prepares again, show it once)."""

    def __init__(self) -> None:
        self._shown: str | None = None  # JSON text of the report last shown

    def write(self, report: ValidationReport, path: Path, *, show: bool) -> None:
        """Write ``report`` to ``path`` and, when ``show``, show it once: in full when it is new; as
        one line when the file already held the same report (shown when it was written, e.g. by
        `tts-lightning prepare` or another process); not at all when this instance already showed it."""
        text = json.dumps(report.to_dict(), sort_keys=True)
        if not show or text == self._shown:
            report.write_json(path)
            self._shown = text  # shown by the caller, or already
            return
        try:
            unchanged = json.dumps(json.loads(path.read_text(encoding="utf-8")), sort_keys=True) == text
        except (OSError, ValueError):
            unchanged = False
        report.write_json(path)
        self._shown = text
        if unchanged:
            flagged = f", {len(report.warnings)} flagged" if report.warnings else ""
            rank_zero_info(
                f"data report unchanged ({path}): {len(report.accepted)} clips accepted, "
                f"{len(report.rejected)} rejected{flagged}"
            )
        else:
            rank_zero_info(f"data report ({path}):\n{report.summary()}")
