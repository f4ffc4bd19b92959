"""Sources of drafts behind one declared protocol (``drafter.Drafter``): the trie, draft models,
early exits, the draft head, the sparse-KV self view, and the merged drafter."""
