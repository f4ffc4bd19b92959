"""The KV cache of a speculative batch: storage and compaction of accepted slots, step
inputs and masks, and the sparse views a self-draft reads."""
