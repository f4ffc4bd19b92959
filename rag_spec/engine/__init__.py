"""The decode loop: prefill, draft, one forward pass over the tree, verify, commit. Below it:
verify/ (what is kept of a tree), the drafters, and the target they all read (rag_spec/target)."""
