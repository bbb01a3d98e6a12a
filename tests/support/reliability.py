"""The reliability suite's rows: each scenario test (marked `reliability`) records what it ran and what it measured
through the `reliability` fixture; `make reliability` runs them all and writes the table into docs/reliability.md.

A row is load, fault, outcome, requests lost and the command that reproduces it. Lost is counted, never stated:
the requests the scenario accepted minus those that got a final answer (their tokens, or an error that says why).
Rows go to `$OVERLAP_RELIABILITY_DIR/rows.jsonl` when that is set (one line per row, appended), nowhere otherwise.

    python -m tests.support.reliability DIR [--doc docs/reliability.md]

prints the table of DIR's rows and, with --doc, puts it between the doc's `<!-- rows -->` markers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROWS_FILE = "rows.jsonl"
AREAS = ("Engine", "Sidecar", "Pods", "Operator", "Security")
BEGIN, END = "<!-- rows -->", "<!-- /rows -->"


@dataclass(slots=True)
class Row:
    area: str
    fault: str
    load: str
    outcome: str
    accepted: int | None  # None: the scenario serves no requests (an operator or a security check)
    answered: int | None
    command: str

    @property
    def lost(self) -> int:
        return (self.accepted or 0) - (self.answered or 0)


class Recorder:
    """What a scenario test calls: `reliability.row(area, fault, load=..., outcome=..., accepted=N, answered=M)`;
    accepted and answered stay None where the scenario serves no requests."""

    def __init__(self, nodeid: str, marker: str | None = None) -> None:
        """marker: e2e or long, the marker a scenario's command must select (make test leaves both out)."""
        where = os.environ.get("OVERLAP_RELIABILITY_DIR")
        self.path = Path(where) / ROWS_FILE if where else None
        self.nodeid, self.flags = nodeid, {"e2e": "-s -m e2e ", "long": "-m long "}.get(marker, "")

    def row(
        self, area: str, fault: str, *, load: str, outcome: str, accepted=None, answered=None, whole_module=False
    ) -> Row:
        """whole_module: the scenario needs the tests before it in its file (what they did is what it checks)."""
        if area not in AREAS:
            raise ValueError(f"area {area!r} is not one of {AREAS}")
        target = self.nodeid.split("::")[0] if whole_module else self.nodeid
        row = Row(
            area, fault, load, outcome, accepted, answered, f".venv/bin/python -m pytest -q {self.flags}'{target}'"
        )
        assert row.lost == 0, f"{row.lost} of {accepted} accepted requests got no answer"
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(json.dumps(asdict(row)) + "\n")
        return row


def read_rows(folder: Path) -> list[Row]:
    path = folder / ROWS_FILE
    rows = [Row(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: (AREAS.index(r.area), r.fault))


def machine() -> str:
    """The CPU a run's figures came from: its model name and the widest instructions the engine's kernels use."""
    from overlap.engine.model.native import cpu_isa

    model = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and (found := re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M)):
        model = found.group(1).strip()
    return f"{model}, {os.cpu_count()} CPUs, {cpu_isa()}"


def table(rows: list[Row]) -> str:
    lines = ["| area | fault | load | outcome | accepted | lost | reproduce |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        counted = r.accepted is not None
        cells = [r.area, r.fault, r.load, r.outcome, str(r.accepted) if counted else "-",
                 f"**{r.lost}**" if counted else "-", f"`{r.command}`"]  # fmt: skip
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.reliability", description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="the run's $OVERLAP_RELIABILITY_DIR")
    parser.add_argument("--doc", type=Path, help=f"markdown file whose {BEGIN} ... {END} section gets the table")
    args = parser.parse_args(argv)
    if not (args.folder / ROWS_FILE).exists():
        print(f"no rows in {args.folder}: did the scenarios run with OVERLAP_RELIABILITY_DIR set?", file=sys.stderr)
        return 2
    rows = read_rows(args.folder)
    text = f"{len(rows)} scenarios, {sum(r.lost for r in rows)} requests lost; machine: {machine()}\n\n{table(rows)}"
    print(text)
    if args.doc:
        doc = args.doc.read_text()
        if BEGIN not in doc or END not in doc:
            print(f"{args.doc} has no {BEGIN} ... {END} section", file=sys.stderr)
            return 2
        head, rest = doc.split(BEGIN, 1)
        args.doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")
        print(f"wrote the table into {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
