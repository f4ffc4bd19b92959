"""The lab: benches that measure rag-spec itself rather than a user's model (a step against
the memory-bandwidth floor, the GPU check), kept outside the wheel. Run them from the
repository root: ``python -m lab.floor``, ``make gpu-check``. They write their JSON into
``lab/results/`` (``RESULTS``), never into docs/: what they found goes into docs/concepts.md as
sentences ("Why the defaults")."""

from pathlib import Path

RESULTS = Path("lab/results")
