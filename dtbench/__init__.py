"""dtbench: a declarative benchmark harness for speculative decoding of causal language models.

The package's layers, each importing only the ones below it (tests/test_import_graph.py checks it):

- :mod:`dtbench.core`: what every layer shares, torch-free (the user-facing error, strict pydantic types, the corpus
  declaration a decoder's params may hold);
- ``dtbench.decoders``: the decoders and their shared chain and tree loops (torch; nothing from the harness);
- ``dtbench.harness``: suites, data, models, measurement, the database;
- ``dtbench.reports``: everything printed from the database;
- ``dtbench.cli``: the ``dtbench`` command.

Plugin authors import from :mod:`dtbench.api` only (docs/plugins.md).
"""
