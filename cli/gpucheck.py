"""``python -m dtbench.cli.gpucheck``: the offline GPU check, kept under its old name; the check itself is the
:mod:`dtbench.gpucheck` package (``python -m dtbench.gpucheck``)."""

from dtbench.gpucheck.command import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
