"""The lab: benches that measure rag-spec itself rather than a user's model (a step against
the memory-bandwidth floor, the GPU check), kept outside the wheel. Run them from the
repository root: ``python -m lab.floor``, ``make gpu-check``."""
