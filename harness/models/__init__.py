"""Models: loading targets, drafts and tokenizers (hub, local, embedded, random shapes), the hub asked once, fingerprints. (``dtbench.harness.models``; docs/architecture.md)."""
