"""Speculation's algorithms: the draft tree, verification, sampling, and one module per drafter."""
