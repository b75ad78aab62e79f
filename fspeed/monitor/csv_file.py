"""The CSV monitor: one row of metrics per step in one file (`metrics.csv`).

Rows are keyed by column name; missing columns are left blank, unknown ones are an error (a typo
in a metric name should not vanish). DeepSpeed's csv_monitor writes one file per tag instead;
one file with a column per metric is what `fspeed-plot` and a spreadsheet read.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any, Optional, Sequence

TRAIN_COLUMNS = (
    "step", "samples", "loss", "val_loss", "lr", "grad_norm", "loss_scale", "skipped",
    "tokens_per_s", "samples_per_s", "elapsed_s",
)
"""The columns of every run; the wall-clock breakdown and the flops profiler add theirs."""


class CSVMonitor:
    """Append rows of metrics to a CSV file, flushing each row (a crash loses at most one row).

    `resumed_at`: the step a resumed run continues from. The rows an earlier attempt wrote for the
    steps after it (trained, then lost to a failure, and trained again now) move to
    `<name>.redone.csv` beside the file, so each step has one row of the run's history."""

    def __init__(self, path: str | os.PathLike, columns: Sequence[str] = TRAIN_COLUMNS,
                 resumed_at: Optional[int] = None):
        self.path = Path(path)
        self.columns = tuple(columns)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        resume = self.path.exists() and self.path.stat().st_size > 0
        if resume:
            with open(self.path, newline="") as f:
                header = next(csv.reader(f), [])
            if tuple(header) != self.columns:
                raise ValueError(
                    f"{self.path} exists with columns {header}, expected {list(self.columns)}; "
                    "choose another path or remove the file"
                )
            if resumed_at is not None:
                self._set_aside_rows_after(resumed_at)
        self._file = open(self.path, "a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=self.columns)
        if not resume:
            self._writer.writeheader()
            self._file.flush()

    def _set_aside_rows_after(self, step: int) -> None:
        with open(self.path, newline="") as f:
            rows = list(csv.DictReader(f))
        kept, later = [], []
        for row in rows:
            (later if row.get("step", "").isdigit() and int(row["step"]) > step else kept).append(row)
        if not later:
            return
        redone = self.path.with_name(f"{self.path.stem}.redone{self.path.suffix}")
        new_file = not redone.exists() or redone.stat().st_size == 0
        with open(redone, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            if new_file:
                writer.writeheader()
            writer.writerows(later)
        staged = self.path.with_name(self.path.name + ".tmp")
        with open(staged, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(kept)
        os.replace(staged, self.path)

    def write(self, row: dict[str, Any]) -> None:
        unknown = set(row) - set(self.columns)
        if unknown:
            raise KeyError(f"unknown metric column(s) {sorted(unknown)}; columns are {list(self.columns)}")
        self._writer.writerow({k: _format(v) for k, v in row.items()})
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "CSVMonitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _format(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, bool):
        return int(value)
    return value
