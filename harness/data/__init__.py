"""Data: the dataset plugins and built-ins, question datasets and chat prompts, documents -> prompts, where documents are read from. (``dtbench.harness.data``; docs/architecture.md)."""
