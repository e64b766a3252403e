"""What DeepSpeed's ZeRO-2 sends per optimizer step, counted, against the formula docs/scaling.md uses
(JSON out).

    python -m pipeline.bench.comm_bytes [--world_sizes 2,4] [--precision fp32|bf16] [--out FILE]

For each world size it starts that many ranks (torchrun; gloo and DS_ACCELERATOR=cpu without a GPU).
Each rank builds the trainer's student (the `tiny` preset by default), its two optimizer groups and a
DeepSpeed engine from the shipped ZeRO-2 JSON (deepspeed_configs/zero2.json: only the micro-batch,
the accumulation and, with --precision fp32, bf16 are changed; --reduce_bucket_sizes json,70000 adds an
engine with another bucket size), and runs optimizer steps on synthetic batches through the real
collator and loss terms. Every collective the rank calls through
torch.distributed during a step is counted (pipeline.distributed.counting_collectives), with its
payload bytes and its caller, so DeepSpeed's own traffic (callers under deepspeed/) is told apart
from the objective's (the loss normalisers, TACO's pool). Nothing of DeepSpeed is replaced.

The formula (`zero2_step_bytes`), per rank and optimizer step, with k micro-batches per step, R ranks,
G optimizer groups of n_g parameters, N_grad the parameters that receive a gradient:
- all_reduce, gradient buckets: k x N_grad x (bytes of the communication dtype). With
  `reduce_scatter: true` DeepSpeed 0.19.8 still all-reduces each bucket (`use_multi_rank_bucket_allreduce`
  defaults to true; `average_tensor` -> `allreduce_and_scatter`), every micro-batch (stage 2 reduces
  in backward, so accumulation does not save it).
- all_reduce, gradient norm (clipping): one fp32 scalar per group, 4 x G bytes.
- all_gather_into_tensor, updated parameters after the step: one call per group of its flat buffer,
  padded to a multiple of 2 x R elements, in the parameters' dtype: sum_g ceil(n_g / 2R) x 2R x bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from pipeline import distributed
from pipeline.bench.common import REPO
from preprocessing import cli

ALIGN_ELEMENTS = 2  # DeepSpeed's nccl_start_alignment_factor: each group's flat buffer is padded to 2 x R
NORM_BYTES = 4  # the fp32 gradient-norm partial each group all-reduces


def zero2_step_bytes(
    *, group_numels: Sequence[int], grad_numel: int, world: int, accum: int, comm_bytes: int, param_bytes: int
) -> dict[str, dict[str, int]]:
    """Payload bytes per rank and optimizer step of DeepSpeed 0.19.8's ZeRO-2 (no offload, no overflow
    check: bf16 with check_grad_overflow false, or fp32), by op and term (see the module docstring)."""
    if world == 1:
        return {}
    return {
        "all_reduce": {
            "gradient_buckets": accum * grad_numel * comm_bytes,
            "gradient_norm": NORM_BYTES * len(group_numels),
        },
        "all_gather_into_tensor": {"parameters": param_bytes * sum(padded_numel(n, world=world) for n in group_numels)},
    }


def padded_numel(numel: int, *, world: int) -> int:
    """A group's flat buffer as ZeRO partitions and all-gathers it: padded to a multiple of 2 x R."""
    align = ALIGN_ELEMENTS * world
    return -(-numel // align) * align


def ring_bytes_sent(op: str, payload: int, *, world: int) -> float:
    """Bytes one rank sends for a payload with NCCL's ring algorithms: all-reduce 2 (R-1)/R x payload
    (reduce-scatter then all-gather), all-gather of the whole result and reduce-scatter (R-1)/R x."""
    factor = {"all_reduce": 2 * (world - 1) / world}.get(op, (world - 1) / world)
    return factor * payload


def bucket_sizes(ready_numels: Sequence[int], *, bucket: int) -> list[int]:
    """The elements of each gradient all-reduce in one backward: DeepSpeed's rule, parameters taken in
    the order their gradients become ready, a bucket sent when the next one would overflow it, the rest
    at the end of backward. (A parameter larger than a bucket goes alone; DeepSpeed may split it further.)"""
    out, filled = [], 0
    for n in ready_numels:
        if filled and filled + n > bucket:
            out.append(filled)
            filled = 0
        filled += n
    return out + ([filled] if filled else [])


def uses_gradient(name: str, *, nsp: bool) -> bool:
    """Whether a student parameter gets a gradient: without NSP (packed shards: taco, mlm) the pooler and
    the NSP head are never run, and DeepSpeed reduces nothing for them (it still all-gathers them)."""
    parts = name.split(".")
    return nsp or not ("pooler" in parts or "seq_relationship" in parts)


# ---------------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------------


def _engine(a: argparse.Namespace, *, world: int, bucket: Optional[int]):
    """(the DeepSpeed engine over a fresh student, as the trainer builds it, with `bucket` as
    reduce_bucket_size unless None; each optimizer group's (parameter name, numel) pairs)."""
    import deepspeed
    from transformers import BertForPreTraining

    from pipeline.modeling.bert_config import bert_config
    from pipeline.modeling.param_groups import param_groups
    from pipeline.modeling.student import Student
    from pipeline.training.config import ScheduleArgs
    from pipeline.training.ds_config import client_scheduler, load_ds_json, resolve_ds_config

    torch.manual_seed(0)
    student = Student(BertForPreTraining(bert_config(a.model_config, vocab_size=a.vocab)))
    ds = load_ds_json(a.ds_config)
    ds["train_micro_batch_size_per_gpu"] = a.micro
    if a.accum is not None:
        ds["gradient_accumulation_steps"] = a.accum
    if a.precision == "fp32":
        ds["bf16"] = {"enabled": False}
        ds.pop("data_types", None)
    if bucket is not None:
        ds["zero_optimization"]["reduce_bucket_size"] = bucket
    schedule = ScheduleArgs(max_steps=1000, lr=1e-4, warmup_steps=10)
    ds = resolve_ds_config(ds, schedule=schedule, world_size=world, path=a.ds_config)
    ds, scheduler = client_scheduler(ds, schedule=schedule)
    groups = param_groups(student)
    names = {id(p): n for n, p in student.named_parameters()}
    layout = [[(names[id(p)], p.numel()) for p in g["params"]] for g in groups]
    engine, _, _, _ = deepspeed.initialize(model=student, model_parameters=groups, config=ds, lr_scheduler=scheduler)
    return engine, layout


def ready_order(model: torch.nn.Module, *, nsp: bool) -> tuple[list[tuple[str, int]], list]:
    """(a list that every backward appends (name, numel) to as each parameter's gradient is accumulated,
    the hook handles): the order in which DeepSpeed's own hooks (post-accumulate-grad) see them."""
    order: list[tuple[str, int]] = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda q, name=name: order.append((name, q.numel())))
        for name, p in model.named_parameters()
        if uses_gradient(name, nsp=nsp)
    ]
    return order, handles


def _batches(a: argparse.Namespace, *, nsp: bool) -> Iterator[dict]:
    from pipeline.bench.gpu import collated_batches

    rank = distributed.rank()
    batches = collated_batches(
        micro=a.micro, count=4 * (rank + 1), seq_len=a.seq_len, vocab=a.vocab, data="nsp" if nsp else "packed",
        option="remove" if nsp else "document", pin=False,
    )  # fmt: skip
    k = rank  # each rank its own batches (the counts must not depend on them)
    while True:
        yield batches[k % len(batches)]
        k += 1


def _program(engine, *, objective: str, nsp: bool):
    """The trainer's step program around `engine` (pipeline.training.step): what a step of
    pipeline/train.py computes, TaCL's teacher aside (this counts MLM and TACO)."""
    from pipeline import objectives
    from pipeline.training.config import ObjectiveArgs
    from pipeline.training.metrics import FlopsModel
    from pipeline.training.nonfinite import NonfiniteGuard
    from pipeline.training.step import StepProgram

    guard = NonfiniteGuard(engine.device)
    guard.install(engine.module)
    return StepProgram(
        engine=engine, objective=objectives.get(objective), args=ObjectiveArgs(objective=objective), nsp=nsp,
        teacher=None, guard=guard, flops=FlopsModel.of(engine.module.config, teacher=False), device=engine.device,
        seed=0, accum=engine.gradient_accumulation_steps(),
    )  # fmt: skip


def _tally(calls: Sequence[distributed.CollectiveCall]) -> dict[str, dict[str, dict[str, Any]]]:
    """{"deepspeed" | "other": {op: {"calls", "bytes", "dtypes", "callers": {caller: [bytes of each call]}}}}."""
    out: dict[str, dict[str, dict[str, Any]]] = {"deepspeed": {}, "other": {}}
    for c in calls:
        side = "deepspeed" if c.caller.startswith("deepspeed" + os.sep) else "other"
        t = out[side].setdefault(c.op, {"calls": 0, "bytes": 0, "dtypes": [], "callers": {}})
        t["calls"] += 1
        t["bytes"] += c.nbytes
        if c.dtype and c.dtype not in t["dtypes"]:
            t["dtypes"].append(c.dtype)
        t["callers"].setdefault(c.caller, []).append(c.nbytes)
    return out


def _expected(
    a: argparse.Namespace, engine, layout: list[list[tuple[str, int]]], *, world: int, nsp: bool
) -> dict[str, Any]:
    """The formula's inputs, read from the model and the JSON (not from DeepSpeed's internals), and
    its bytes per op."""
    group_numels = [sum(n for _, n in g) for g in layout]
    grad_numel = sum(n for g in layout for name, n in g if uses_gradient(name, nsp=nsp))
    param_bytes = 2 if engine.bfloat16_enabled() or engine.fp16_enabled() else 4
    comm = json.loads(Path(a.ds_config).read_text()).get("communication_data_type")
    comm_bytes = {"fp32": 4, "fp16": 2, "bf16": 2}[comm] if comm else param_bytes
    terms = zero2_step_bytes(
        group_numels=group_numels,
        grad_numel=grad_numel,
        world=world,
        accum=engine.gradient_accumulation_steps(),
        comm_bytes=comm_bytes,
        param_bytes=param_bytes,
    )
    return {
        "inputs": {
            "group_numels": group_numels,
            "grad_numel": grad_numel,
            "param_bytes": param_bytes,
            "comm_bytes": comm_bytes,
            "reduce_bucket_size": engine.zero_reduce_bucket_size(),
        },
        "terms": terms,
        "bytes": {op: sum(t.values()) for op, t in terms.items()},
    }


def count_case(a: argparse.Namespace, *, bucket: Optional[int]) -> Optional[dict[str, Any]]:
    """Count the collectives of `a.steps` optimizer steps (after `a.warmup`) of one engine; rank 0's
    summary (None on the other ranks)."""

    from pipeline.training.metrics import Meter
    from pipeline.training.state import TrainState
    from pipeline.training.step import Batches, train_step

    world, nsp = distributed.world_size(), a.objective == "mlm"
    engine, layout = _engine(a, world=world, bucket=bucket)
    program = _program(engine, objective=a.objective, nsp=nsp)
    batches, state = Batches(_batches(a, nsp=nsp)), TrainState()
    meter = Meter(program.objective.metric_keys(nsp=nsp), engine.device)
    order, handles = ready_order(engine.module, nsp=nsp)
    steps = []
    for step in range(a.warmup + a.steps):
        order.clear()
        with distributed.counting_collectives() as calls:
            train_step(program, state, batches, meter)
        if step >= a.warmup:
            steps.append(_tally(calls))
    for h in handles:
        h.remove()
    tallies = distributed.all_gather_object(steps)
    if not distributed.is_main():
        return None
    expected = _expected(a, engine, layout, world=world, nsp=nsp)
    per_micro = order[: len(order) // engine.gradient_accumulation_steps()]
    buckets = bucket_sizes([n for _, n in per_micro], bucket=expected["inputs"]["reduce_bucket_size"])
    return _summary(a, engine, tallies, expected, buckets, world=world)


def _summary(a, engine, tallies: list[list[dict]], expected: dict, buckets: list[int], *, world: int) -> dict[str, Any]:
    """The first counted step, whether every step of every rank counted the same, the formula (bytes,
    calls, and the size of each gradient all-reduce), and the ring bytes one rank sends."""
    step = tallies[0][0]
    ds = step["deepspeed"]
    accum, n_groups = engine.gradient_accumulation_steps(), len(expected["inputs"]["group_numels"])
    calls = {"all_reduce": accum * len(buckets) + n_groups, "all_gather_into_tensor": n_groups}
    bucket_bytes = [n * expected["inputs"]["comm_bytes"] for n in buckets] * accum
    counted_buckets = ds.get("all_reduce", {}).get("callers", {}).get(_BUCKET_CALLER, [])
    counted = {op: t["bytes"] for op, t in ds.items()}
    return {
        "world_size": world,
        "precision": a.precision,
        "objective": a.objective,
        "micro_batch": a.micro,
        "accumulation": accum,
        "reduce_bucket_size": expected["inputs"]["reduce_bucket_size"],
        "steps_counted": a.steps,
        "identical_steps_and_ranks": all(s == step for rank in tallies for s in rank),
        "per_step": step,
        "formula": {**expected, "calls": calls, "gradient_all_reduce_bytes": bucket_bytes},
        "matches_formula": counted == expected["bytes"]
        and {op: t["calls"] for op, t in ds.items()} == calls
        and counted_buckets == bucket_bytes,
        "ring_bytes_sent_per_rank": {op: ring_bytes_sent(op, b, world=world) for op, b in counted.items()},
    }


# DeepSpeed 0.19.8's function that all-reduces a gradient bucket (under average_tensor).
_BUCKET_CALLER = "deepspeed/runtime/zero/stage_1_and_2.py:allreduce_bucket"


def worker(a: argparse.Namespace) -> None:
    """One rank: one engine per requested reduce_bucket_size; rank 0 writes the summaries to `a.result`."""
    distributed.install_collective_counter()  # before DeepSpeed's comm backend keeps references
    distributed.init_process_group(backend=distributed.default_backend())
    cases = [count_case(a, bucket=None if b == "json" else int(float(b))) for b in a.reduce_bucket_sizes.split(",")]
    if distributed.is_main():
        Path(a.result).write_text(json.dumps(cases))
    distributed.barrier()


# ---------------------------------------------------------------------------------------------------
# The launcher
# ---------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = cli.bench_parser(__doc__.split("\n")[0], out=True)
    p.add_argument("--world_sizes", default="2,4", help="comma-separated rank counts, one run each")
    p.add_argument("--ds_config", default=str(REPO / "deepspeed_configs" / "zero2.json"))
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="fp32: bf16.enabled false")
    p.add_argument("--objective", choices=("mlm", "taco"), default="mlm", help="mlm: with NSP (every parameter trains)")
    p.add_argument("--model_config", default="tiny")
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--accum", type=int, default=None, help="micro-batches per step (default: the JSON's)")
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument(
        "--reduce_bucket_sizes",
        default="json",
        help="comma-separated zero_optimization.reduce_bucket_size values, one engine each (json: the JSON's)",
    )
    p.add_argument("--steps", type=int, default=2, help="steps counted")
    p.add_argument("--warmup", type=int, default=1, help="steps run first, not counted")
    p.add_argument("--timeout", type=float, default=300, help="seconds for all the runs")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


# What a rank needs of the launcher's arguments.
_WORKER_ARGS = (
    "ds_config", "precision", "objective", "model_config", "vocab", "micro", "accum", "seq_len",
    "reduce_bucket_sizes", "steps", "warmup",
)  # fmt: skip


def launch_world(argv: Sequence[str], *, world: int, result: Path) -> subprocess.Popen:
    """Start `world` ranks with torchrun; rank 0 writes its result to `result`."""
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    cmd += ["-m", "pipeline.bench.comm_bytes", *argv, "--worker", "--result", str(result)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def run_worlds(argv: Sequence[str], *, worlds: Sequence[int], timeout: float) -> dict[str, dict[str, Any]]:
    """Every world size at once (the ranks mostly wait on imports: on a small machine running them
    side by side saves time); rank 0's result of each."""
    with tempfile.TemporaryDirectory(prefix="comm_bytes_") as tmp:
        results = {w: Path(tmp) / f"world{w}.json" for w in worlds}
        procs = {w: launch_world(argv, world=w, result=results[w]) for w in worlds}
        errors = {w: p.communicate(timeout=timeout)[1] for w, p in procs.items()}
        for w, p in procs.items():
            if p.returncode != 0 or not results[w].is_file():
                raise RuntimeError(f"{w} ranks failed (exit {p.returncode}):\n{errors[w][-4000:]}")
        return {str(w): json.loads(results[w].read_text()) for w in worlds}


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parser().parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    worlds = [int(w) for w in a.world_sizes.split(",")]
    child = [f"--{k}={getattr(a, k)}" for k in _WORKER_ARGS if getattr(a, k) is not None]
    runs = run_worlds(child, worlds=worlds, timeout=a.timeout)
    cli.emit_json(
        {
            "benchmark": "comm_bytes",
            "deepspeed": _deepspeed_version(),
            "ds_config": a.ds_config,
            "runs": runs,
            "matches_formula": all(
                c["matches_formula"] and c["identical_steps_and_ranks"] for r in runs.values() for c in r
            ),
        },
        a.out,
    )
    return 0


def _deepspeed_version() -> str:
    from importlib.metadata import version

    return version("deepspeed")


if __name__ == "__main__":
    sys.exit(main())
