"""What travels to the GPU node (issue 31): the repository's bytes a call carries and the kit's wheels, against the
budget. Standard library only: ``cli/offline.py`` imports it before dtbench is installed."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KIT_BUDGET_MIB = 48.0  # repository + kit: 64 MiB travel per call to the node, less room


def travelling_bytes(repo: Path = REPO) -> int:
    """Bytes of what a call to the node carries of the repository: tracked and untracked files git does not ignore."""
    out = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout
    total = 0
    for rel in filter(None, out.decode().split("\0")):
        path = repo / rel
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def kit_summary(kit: Path, repo: Path = REPO, budget_mib: float = KIT_BUDGET_MIB) -> dict:
    """What travels: the repository's bytes, each wheel's, the total, and whether it fits ``budget_mib``."""
    wheels = {p.name: p.stat().st_size for p in sorted(kit.glob("*.whl"))}
    repo_b = travelling_bytes(repo)
    total = repo_b + sum(wheels.values())
    return {
        "repository_bytes": repo_b,
        "wheels": wheels,
        "kit_bytes": sum(wheels.values()),
        "total_bytes": total,
        "budget_bytes": int(budget_mib * 2**20),
        "fits": total <= budget_mib * 2**20,
    }


def print_summary(summary: dict) -> None:
    """Print :func:`kit_summary`'s wheels, the repository and the total against the budget (MiB)."""
    mib = 2**20
    for name, size in summary["wheels"].items():
        print(f"  {size / mib:6.2f} MiB  {name}")
    print(f"  {summary['repository_bytes'] / mib:6.2f} MiB  the repository (tracked + untracked, not ignored)")
    print(
        f"  {summary['total_bytes'] / mib:6.2f} MiB  in all, of {summary['budget_bytes'] / mib:.0f} MiB allowed"
        + ("" if summary["fits"] else "  <- TOO LARGE")
    )
