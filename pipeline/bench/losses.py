"""Benchmark: forward+backward time and peak memory of taco_loss and tacl_loss against the upstream
formulations (TACO's materialised [B, L, K, D] negatives + einsum; TaCL's softmax over every position,
padding included), each also as a share of a BERT-base MLM forward+backward on the same batch.

    python -m pipeline.bench.losses                 # B=32, L=256, D=768, K=50, fp32, CPU
    python -m pipeline.bench.losses --quick         # small shapes and a tiny BERT: a smoke run
    python -m pipeline.bench.losses --device cuda   # the same on a GPU

Prints one JSON object. Times: medians over --repeats rounds in which the four loss cases run
interleaved in one process (load on a shared machine drifts more between processes than between
cases), after a warm-up call. Peak memory: each case in a fresh process, after a warm-up call, the
rise of one call's peak over the memory held before it: on CPU the peak resident set (VmHWM, reset
just before the call; Linux), on CUDA torch.cuda.max_memory_allocated. Set --threads to pin torch's CPU threads.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import statistics
import time
from pathlib import Path

import psutil
import torch

from pipeline.data.masking import IGNORE_INDEX
from pipeline.losses import TACO_POOL_SIZE, tacl_loss, taco_loss
from pipeline.losses.reference import upstream_tacl, upstream_taco
from preprocessing import cli

# Each case: (setup(args, device) -> state, step(args, state) -> None); setup builds the inputs
# outside the measurement.


def _bert_config(args):
    from transformers import BertConfig

    if args.quick:
        return BertConfig(
            vocab_size=1000,
            hidden_size=args.hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=4 * args.hidden,
            max_position_embeddings=args.seq_len,
        )
    return BertConfig()  # BERT-base: 12 layers, 768 wide, 30522 tokens


def _hidden_pair(args, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (args.batch_size, args.seq_len, args.hidden)
    hidden = torch.randn(shape, generator=g).to(device).requires_grad_(True)
    embeddings = torch.randn(shape, generator=g).to(device).requires_grad_(True)
    return hidden, embeddings


def _tacl_inputs(args, device):
    g = torch.Generator(device="cpu").manual_seed(1)
    B, L = args.batch_size, args.seq_len
    student, teacher = _hidden_pair(args, device)
    teacher = teacher.detach()
    lengths = torch.randint(L // 2, L + 1, (B,), generator=g)
    attention = (torch.arange(L)[None, :] < lengths[:, None]).long()
    masked = (torch.rand(B, L, generator=g) < 0.15) & attention.bool()
    return student, teacher, masked.to(device), attention.to(device)


def setup_taco(args, device):
    hidden, embeddings = _hidden_pair(args, device)
    attention = torch.ones(args.batch_size, args.seq_len, dtype=torch.long, device=device)
    return dict(
        hidden=hidden,
        embeddings=embeddings,
        attention=attention,
        generator=torch.Generator(device=device).manual_seed(0),
    )


def step_taco(args, s):
    loss, _ = taco_loss(
        s["hidden"],
        embeddings_BLD=s["embeddings"],
        attention_mask_BL=s["attention"],
        num_negatives=args.num_negatives,
        generator=s["generator"],
        pool_size=args.pool_size,
    )
    loss.backward()


def step_taco_upstream(args, s):
    upstream_taco(s["hidden"], s["embeddings"], num_negatives=args.num_negatives).backward()


def setup_tacl(args, device):
    student, teacher, masked, attention = _tacl_inputs(args, device)
    return dict(student=student, teacher=teacher, masked=masked, attention=attention)


def step_tacl(args, s):
    loss, _ = tacl_loss(s["student"], teacher_BLD=s["teacher"], masked_BL=s["masked"], attention_mask_BL=s["attention"])
    loss.backward()


def step_tacl_upstream(args, s):
    upstream_tacl(s["student"], s["teacher"], s["masked"]).backward()


def setup_bert(args, device):
    from transformers import BertForMaskedLM

    config = _bert_config(args)
    model = BertForMaskedLM(config).to(device).train()
    g = torch.Generator(device="cpu").manual_seed(2)
    B, L = args.batch_size, args.seq_len
    input_ids = torch.randint(5, config.vocab_size, (B, L), generator=g)
    labels = torch.where(torch.rand(B, L, generator=g) < 0.15, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    return dict(
        model=model,
        input_ids=input_ids.to(device),
        labels=labels.to(device),
        attention=torch.ones(B, L, dtype=torch.long, device=device),
    )


def step_bert(args, s):
    s["model"].zero_grad(set_to_none=True)
    out = s["model"](input_ids=s["input_ids"], attention_mask=s["attention"], labels=s["labels"])
    out.loss.backward()


CASES = {
    "taco_loss": (setup_taco, step_taco),
    "taco_upstream": (setup_taco, step_taco_upstream),
    "tacl_loss": (setup_tacl, step_tacl),
    "tacl_upstream": (setup_tacl, step_tacl_upstream),
    "bert_base_mlm_step": (setup_bert, step_bert),
}


LOSS_CASES = [name for name in CASES if not name.startswith("bert")]


def _clear_grads(state):
    for value in state.values():
        if isinstance(value, torch.Tensor):
            value.grad = None


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(step, args, state, device) -> float:
    _clear_grads(state)
    _sync(device)
    start = time.perf_counter()
    step(args, state)
    _sync(device)
    return time.perf_counter() - start


def time_cases(names, args):
    """Median forward+backward seconds per case. The cases run interleaved, round after round, in
    one process: on a shared machine load drifts between processes more than between cases."""
    device = torch.device(args.device)
    states = {name: CASES[name][0](args, device) for name in names}
    for name in names:  # warm-up: kernel selection, thread pools, lazy initialisation
        _timed(CASES[name][1], args, states[name], device)
    times = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            times[name].append(_timed(CASES[name][1], args, states[name], device))
    return {name: dict(time_s=statistics.median(t), times_s=t) for name, t in times.items()}


def _peak_memory(name, args, queue):
    """Runs in a fresh process: setup, a warm-up call, then the peak of one more call over the
    memory held before it."""
    device = torch.device(args.device)
    setup, step = CASES[name]
    state = setup(args, device)
    _timed(step, args, state, device)
    _clear_grads(state)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        _reset_peak_rss()
        before = psutil.Process().memory_info().rss
    _timed(step, args, state, device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _peak_rss() - before
    queue.put(max(peak, 0) / 2**20)


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the process's peak resident set (VmHWM) to its current
    one, so the next reading is the peak of what follows, not of the imports before."""
    Path("/proc/self/clear_refs").write_text("5")


def _peak_rss() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def peak_memory_mb(name, args) -> float:
    # A fixed mmap threshold: glibc then serves every large block by mmap and unmaps it on free, so
    # the resident set follows live memory (freed blocks do not linger in it).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_peak_memory, args=(name, args, queue))
    process.start()
    peak = queue.get()
    process.join()
    return peak


def main(argv=None):
    parser = cli.bench_parser(
        __doc__, smoke="small shapes and a tiny BERT (smoke run)", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch_size", type=int, default=None, help="default 32 (--quick: 4)")
    parser.add_argument("--seq_len", type=int, default=None, help="default 256 (--quick: 64)")
    parser.add_argument("--hidden", type=int, default=None, help="default 768 (--quick: 64)")
    parser.add_argument("--num_negatives", type=int, default=None, help="default 50 (--quick: 8)")
    parser.add_argument("--pool_size", type=int, default=TACO_POOL_SIZE, help="taco_loss's pool rows")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds of the loss cases")
    parser.add_argument("--bert_repeats", type=int, default=3, help="timed BERT-base steps")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip_bert", action="store_true", help="leave out the BERT-base step (slow on CPU)")
    args = parser.parse_args(argv)
    defaults = dict(batch_size=(4, 32), seq_len=(64, 256), hidden=(64, 768), num_negatives=(8, 50))
    for key, (quick, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.batch_size < 2:
        parser.error(f"--batch_size {args.batch_size}: TACO needs >= 2 sequences")

    if args.threads:
        torch.set_num_threads(args.threads)
    names = LOSS_CASES + ([] if args.skip_bert else ["bert_base_mlm_step"])
    # Peaks first, each in its own process, while this one still holds nothing: the timed BERT-base
    # step leaves ~10 GB in this process's heap, and a child measuring upstream TACO next to it ran a
    # 24 GB machine out of memory.
    peaks = {name: peak_memory_mb(name, args) for name in names}
    results = time_cases(LOSS_CASES, args)
    if not args.skip_bert:
        results.update(
            time_cases(["bert_base_mlm_step"], argparse.Namespace(**{**vars(args), "repeats": args.bert_repeats}))
        )
    for name in results:
        results[name]["peak_mb"] = peaks[name]

    def memory_ratio(upstream, ours):
        # Below ~1 MB the resident-set reading is page noise (--quick): no ratio.
        return upstream / ours if ours >= 1.0 else None

    summary = {
        "taco_speedup_vs_upstream": results["taco_upstream"]["time_s"] / results["taco_loss"]["time_s"],
        "taco_memory_ratio_vs_upstream": memory_ratio(
            results["taco_upstream"]["peak_mb"], results["taco_loss"]["peak_mb"]
        ),
        "tacl_speedup_vs_upstream": results["tacl_upstream"]["time_s"] / results["tacl_loss"]["time_s"],
        "tacl_memory_ratio_vs_upstream": memory_ratio(
            results["tacl_upstream"]["peak_mb"], results["tacl_loss"]["peak_mb"]
        ),
    }
    if "bert_base_mlm_step" in results:
        bert = results["bert_base_mlm_step"]["time_s"]
        for name in ("taco_loss", "taco_upstream", "tacl_loss", "tacl_upstream"):
            summary[f"{name}_share_of_bert_step"] = results[name]["time_s"] / bert
    config = {k: v for k, v in vars(args).items()}
    config.update(torch=torch.__version__, threads_default=torch.get_num_threads(), dtype="float32")
    print(json.dumps(dict(config=config, results=results, summary=summary), indent=2))


if __name__ == "__main__":
    main()
