"""Token trees and what is kept of them: verify, acceptance (greedy and speculative sampling)
and the sampling knobs, shared by the loop and the drafters."""
