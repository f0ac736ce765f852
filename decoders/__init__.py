"""Built-in dtbench decoders (``dtbench.decoders``), each registered through the ``dtbench.decoders`` entry points."""
