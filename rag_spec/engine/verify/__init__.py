"""What is kept of a token tree: verify, acceptance (greedy and speculative sampling) and the
grammar masks of constrained decoding."""
