"""Is dtbench's `ar` baseline as fast as transformers' own greedy `generate`? (A slow baseline inflates every speedup.)

Runs both side by side on the same real prompts, interleaved (ar, hf, ar, hf, ...) so machine noise hits both
alike, and prints per-run throughput, medians and the median ratio. Both generate exactly T tokens, EOS ignored,
and their outputs are checked equal.

    python bench/ar_vs_hf.py --data-dir ../shared/data --prompts 3 --l-max 128 -T 64 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dtbench.decoders.ar import ARParams, Autoregressive
from dtbench.harness.data import datasets as data
from dtbench.harness.data import selection
from dtbench.harness.measurement.measure import measure
from dtbench.harness.models import loading as models
from dtbench.harness.suites.suite import DatasetSpec, ModelSpec


def hf_generate(model, ids: list[int], T: int) -> tuple[list[int], float]:
    x = torch.tensor([ids])
    start = time.perf_counter()
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        do_sample=False,
        max_new_tokens=T,
        min_new_tokens=T,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist(), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--l-max", "--prompt-cap", dest="l_max", type=int, default=128)  # L_max (old name too)
    ap.add_argument("-T", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    spec = ModelSpec(model="smollm2-135m", dtype="float32")
    tok = models.load_tokenizer(spec)
    model = models.load_model(spec, torch.device("cpu")).model
    ds = DatasetSpec(name="wikitext-2", prompts=args.prompts, warmup=0, L_max=args.l_max)
    prompts = selection.select_prompts(data.load_documents(ds, args.data_dir), tok, args.prompts, args.l_max, 0)
    ar = Autoregressive(model, None, ARParams())
    hf_generate(model, list(prompts[0].token_ids), 4)  # warm both paths once
    measure(ar, prompts[0].token_ids, 4, torch.device("cpu"))

    ours, theirs = [], []
    for r in range(args.repeats):
        for p in prompts:
            m = measure(ar, p.token_ids, args.T, torch.device("cpu"))
            hf_tokens, hf_s = hf_generate(model, list(p.token_ids), args.T)
            assert m.tokens == hf_tokens, f"outputs differ on prompt {p.index}"
            ours.append(args.T / m.step_times[-1])
            theirs.append(args.T / hf_s)
            print(f"repeat {r} prompt {p.index}: ar {ours[-1]:6.2f} t/s   hf generate {theirs[-1]:6.2f} t/s")
    ratios = [a / b for a, b in zip(ours, theirs)]
    print(
        f"median ar {statistics.median(ours):.2f} t/s, hf generate {statistics.median(theirs):.2f} t/s, "
        f"median ratio ar/hf {statistics.median(ratios):.3f} over {len(ratios)} pairs (torch threads {torch.get_num_threads()})"
    )


if __name__ == "__main__":
    main()
