"""Suites and plans: the suite schema and files, the decoder entries, the run plan and its checks, prompt grouping. (``dtbench.harness.suites``; docs/architecture.md)."""
