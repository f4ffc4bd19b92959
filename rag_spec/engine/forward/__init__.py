"""Every forward pass of the target: the runner, a private copy of the user's model (eager,
compiled, static buckets, feature capture)."""
