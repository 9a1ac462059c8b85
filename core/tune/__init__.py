"""Measuring the machine and choosing from it: kernels, latency profile, memory budget, probe, tuner, monitor."""
