"""``python -m dtbench.gpucheck``: the offline GPU check (:mod:`dtbench.gpucheck`)."""

from dtbench.gpucheck.command import main

if __name__ == "__main__":
    main()
