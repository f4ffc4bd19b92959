"""The transformers engine: every forward pass of the target through the runner (a private copy
of the user's model; eager, compiled, static buckets, feature capture) and the KV cache of a
speculative batch (storage and compaction of accepted slots, step inputs and masks, the sparse
views a self-draft reads)."""
