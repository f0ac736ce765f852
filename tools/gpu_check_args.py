"""The arguments of ``tools/gpu-check.sh`` checked before anything is installed (issue 67): a typo in ``--steps`` or
``--budget`` is one line and exit 2 in a second, not after the kit's install on a leased GPU node.

Standard library only (it runs on the node's Python before dtbench is installed). The step names are read from
``gpucheck/common.py`` (``STEPS``) without importing it; the rules repeat ``python -m dtbench.gpucheck``'s options
(gpucheck/command.py), which checks them again after the install.

Usage: ``python tools/gpu_check_args.py [ARGS...]``: exit 0 when the arguments are valid, else one line on stderr
and exit 2.
"""

from __future__ import annotations

import ast
import math
import sys
from pathlib import Path

FLAGS = {"--small", "--plan"}
VALUED = {"--device", "--steps", "--decoders", "--budget"}
DEVICES = ("auto", "cuda", "cpu")


def steps() -> tuple[str, ...]:
    """``STEPS`` of gpucheck/common.py, read from its source."""
    tree = ast.parse((Path(__file__).resolve().parents[1] / "gpucheck" / "common.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "STEPS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    return ()


def problem(args: list[str]) -> str | None:
    """The first problem of ``args`` in one line, or None."""
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name in FLAGS and not eq:
            i += 1
            continue
        if name not in VALUED:
            return f"unknown option {arg!r} (options: {', '.join(sorted(FLAGS | VALUED))})"
        if not eq:
            if i + 1 >= len(args):
                return f"{name} needs a value"
            value, i = args[i + 1], i + 1
        i += 1
        if name == "--device" and value not in DEVICES:
            return f"--device: {value!r} is not one of {', '.join(DEVICES)}"
        if name == "--steps":
            known = steps()
            chosen = [s.strip() for s in value.split(",") if s.strip()]
            bad = [s for s in chosen if s not in known]
            if bad or not chosen:
                return (
                    f"--steps: unknown step {bad[0]!r} (choose from {', '.join(known)})"
                    if bad
                    else ("--steps: name at least one step")
                )
        if name == "--budget":
            try:
                seconds = float(value)
            except ValueError:
                seconds = math.nan
            if not math.isfinite(seconds) or seconds < 1:
                return f"--budget: {value!r} is not a number of seconds >= 1"
    return None


def main() -> int:
    found = problem(sys.argv[1:])
    if found:
        print(f"error: {found}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
