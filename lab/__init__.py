"""The lab: benches that measure rag-spec itself rather than a user's model (a step against
the memory-bandwidth floor, the GPU check), kept outside the wheel. Run them from the
repository root: ``python -m lab.floor``, ``make gpu-check``. They write their JSON into
``lab/results/`` (``RESULTS``), never into docs/: what they found goes into docs/concepts.md as
sentences ("Why the defaults")."""

import json
from pathlib import Path

RESULTS = Path("lab/results")


def write_result(report: dict, name: str) -> Path:
    """``report`` as lab/results/NAME.json; says where it went."""
    out = RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return out
