"""The model being decoded, below the decode loop and the drafters, which both read it: the
token tree a step runs over (``tree``), what its logits become under the sampling knobs
(``sampling``), and the engine that runs it (``transformers/``: the runner's forward passes on a
private copy of the user's model, eager or compiled, and the tree KV cache)."""
