"""Calibration: forward-latency curves measured, stored, exported, and priced as a cost function; the roofline. (``dtbench.harness.calibration``; docs/architecture.md)."""
