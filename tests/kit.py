"""Helpers for runner-level tests: tiny real model folders the runner loads like any local model, and tiny
third-party plugin distributions "installed" into a temporary folder on sys.path (a dist-info with entry points).
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import torch
import yaml
from click.testing import CliRunner


def save_tiny_llama(folder: Path, tokenizer, *, vocab: int | None = None, seed: int = 0, noise: float = 0.0) -> Path:
    """A 1-layer float64 Llama over the embedded tokenizer's vocabulary (or ``vocab`` rows), saved with that
    tokenizer as a local model folder. ``noise`` perturbs the weights (a draft that partly agrees)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab or len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # confident next-token distributions: fewer near-ties, drafts accepted
        if noise:
            gen = torch.Generator().manual_seed(seed + 1)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * noise)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def tiny_pair(root: Path) -> tuple[Path, Path]:
    """(target folder, draft folder): a tiny model and a slightly perturbed copy, both over SmolLM2's tokenizer."""
    from dtbench.harness.models import loading as models
    from dtbench.harness.suites.suite import ModelSpec

    tok = models.load_tokenizer(ModelSpec())
    return save_tiny_llama(root / "target", tok), save_tiny_llama(root / "draft", tok, noise=0.02)


def suite_dict(target: Path, draft: Path, decoders: list, **extra) -> dict:
    """A small CPU suite on WikiText-2 over the tiny float64 pair, measured in the test's own process
    (``isolation: none``, explicit since process isolation is the default on every device, issue 50): tests patch
    the harness in-process (monkeypatch reaches no child), and a child per run costs its start and a model load
    (about 3-4 s on the CI's 2 cores). Tests of isolation itself pass ``isolation="process"``."""
    return {
        "name": "kit",
        "seed": 0,
        "device": "cpu",
        "target": {"model": str(target), "dtype": "float64"},
        "draft": {"model": str(draft), "dtype": "float64"},
        "datasets": [{"name": "wikitext-2", "prompts": 2, "warmup": 1, "L_max": 16}],
        "generation_lengths": [6],
        "decoders": decoders,
        "isolation": "none",
        **extra,
    }


def write_suite(folder: Path, suite: dict | str, name: str = "suite.yaml") -> str:
    path = folder / name
    path.write_text(suite if isinstance(suite, str) else yaml.safe_dump(suite, sort_keys=False))
    return str(path)


def invoke(*args: str):
    from dtbench.cli.main import cli

    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def install_plugin(
    monkeypatch,
    root: Path,
    dist: str,
    entry_points: dict[str, str],
    source: str,
    module: str | None = None,
    group: str = "dtbench.decoders",
) -> None:
    """Install a one-module distribution ``dist`` into ``root`` (a dist-info with METADATA and entry_points.txt,
    registering ``entry_points`` under the entry-point ``group``) and put ``root`` on sys.path for this test."""
    module = module or dist.replace("-", "_")
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{module}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, module, raising=False)
    importlib.invalidate_caches()


def one_line_error(result, *needles: str, code: int = 2) -> str:
    """A user error: exit ``code``, a single 'error:' line on stderr naming the problem, no traceback."""
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def fast_calibration_settings():
    """A ``calibrate.Settings`` subclass timing one forward per point in one pass (a class, so code reading
    ``calibrate.Settings.min_time_s`` still works when tests patch it in), for runs' calibrations in tests."""
    from dataclasses import dataclass

    from dtbench.harness.calibration import calibrate as cal

    @dataclass
    class Fast(cal.Settings):
        min_repeats: int = 1
        min_time_s: float = 0.0
        warmup: int = 0
        passes: int = 1

    return Fast
