"""The communication model of docs/scaling.md (JSON, or the page's tables with --markdown): what
DeepSpeed 0.19.8's ZeRO-2 sends per step for BERT-base and BERT-large (the formula pipeline.bench.comm_bytes
checks against counted collectives), how long NCCL takes for it on rail-optimised 8-GPU nodes, how long
the step computes (docs/objectives.md's FLOPs model at an assumed MFU), and what stays exposed.

    python -m pipeline.bench.comm_model [--markdown]

Model estimates only: nothing here was measured on a GPU. The assumptions are the defaults of
`Cluster` and `Device` below; the page states them.

Per micro-batch the model replays DeepSpeed's overlapped reduction: backward produces the gradients
in the order a twin of the model (same layers, narrow) produces them, each parameter after its share
of the backward FLOPs; a bucket is all-reduced on the side stream when the next gradient would
overflow it, and before issuing it the compute stream waits for the previous bucket's all-reduce
(DeepSpeed's `average_tensor` under overlap_comm); the last bucket goes after backward, and the
epilogue waits for it. Per step: the gradient-norm all-reduces, then the parameter all-gather, both
exposed (DeepSpeed runs them after backward, outside any overlap). The optimizer's own update (Adam
on 1/R of the parameters, memory-bound) is left out: under 1% of a step at 8 GPUs and less beyond.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Optional

import torch

from pipeline.bench.comm_bytes import (
    NORM_BYTES,
    padded_numel,
    ready_order,
    ring_bytes_sent,
    uses_gradient,
    zero2_step_bytes,
)

MODELS = ("base", "large")
WORLDS = (8, 16, 64)
SEQ_LEN, MASK_RATE, VOCAB = 128, 0.15, 30522
BUCKETS = (5e6, 1e7, 2.5e7, 5e7, 1e8, 2e8)  # reduce_bucket_size candidates, elements
BUCKET = 1e7  # the one the 64-GPU configs take from this model (docs/scaling.md, bucket_rows)


@dataclass(frozen=True)
class Cluster:
    """Links as NCCL's bus bandwidth (nccl-tests' busbw): a collective of S bytes over R ranks takes
    latency + f x S / busbw, f = 2 (R-1)/R for all-reduce, (R-1)/R for all-gather.

    Inside a node: NVLink 4 through NVSwitch, 450 GB/s per direction per H100, of which NCCL's rings
    reach ~80%. Across nodes, rail-optimised: one 400 Gb/s NIC per GPU (8 per node), and NCCL runs one
    ring (channel) per rail, so a node's 8 NICs carry 1/8 of the data each: busbw = 8 x the NIC's
    ~40 GB/s (80% of 50 GB/s), capped by NVLink's."""

    gpus_per_node: int = 8
    nvlink_busbw: float = 360e9
    nic_busbw: float = 40e9
    latency_node: float = 20e-6  # per collective, inside a node
    latency_fabric: float = 60e-6  # per collective, across nodes (a ring's hops grow with R)

    def busbw(self, world: int) -> float:
        if world <= self.gpus_per_node:
            return self.nvlink_busbw
        return min(self.nvlink_busbw, self.gpus_per_node * self.nic_busbw)

    def seconds(self, op: str, nbytes: float, *, world: int) -> float:
        latency = self.latency_node if world <= self.gpus_per_node else self.latency_fabric
        return latency + ring_bytes_sent(op, nbytes, world=world) / self.busbw(world)


@dataclass(frozen=True)
class Device:
    """H100 SXM: 989 TFLOP/s dense bf16, at an assumed 50% MFU (the project's target)."""

    peak_flops: float = 989e12
    mfu: float = 0.5

    @property
    def flops_per_s(self) -> float:
        return self.peak_flops * self.mfu


@dataclass(frozen=True)
class Layout:
    """A student as ZeRO-2 sees it (TACO: no NSP, so no pooler or NSP-head gradients)."""

    model: str
    ready: tuple[tuple[str, int], ...]  # parameters that get a gradient, in the order they get it
    groups: tuple[int, ...]  # numel of each optimizer group (decayed, not)
    config: Any  # the BertConfig

    @property
    def grad_numel(self) -> int:
        return sum(n for _, n in self.ready)


def _twin_order(model: str) -> list[str]:
    """Parameter names in the order their gradients are accumulated in one TACO micro-batch, from a
    narrow twin (same layers, width 64): the order depends on the graph, not on the widths."""
    from transformers import BertForPreTraining

    from pipeline import objectives
    from pipeline.bench.gpu import collated_batches
    from pipeline.modeling.bert_config import PRESETS, bert_config
    from pipeline.modeling.student import Student
    from pipeline.objectives import LossInputs
    from pipeline.training.config import ObjectiveArgs

    cfg = bert_config(model, vocab_size=1024)
    cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size = 64, 2, 256
    cfg.num_hidden_layers = PRESETS[model]["num_hidden_layers"]
    torch.manual_seed(0)
    twin = Student(BertForPreTraining(cfg))
    order, handles = ready_order(twin, nsp=False)
    (batch,) = collated_batches(micro=2, count=1, seq_len=32, vocab=1024, data="packed", option="document", pin=False)
    out = twin(batch, with_embeddings=True)
    inputs = LossInputs(args=ObjectiveArgs(objective="taco"), teacher=None, generator=torch.Generator().manual_seed(0))
    objectives.get("taco").losses(out, batch, nsp=False, inputs=inputs).total.backward()
    for h in handles:
        h.remove()
    return [name for name, _ in order]


@cache
def layout(model: str) -> Layout:
    """BERT-`model` with bert-base's 30522-token vocabulary: real sizes (on the meta device), the
    twin's gradient order, the trainer's two optimizer groups."""
    from transformers import BertForPreTraining

    from pipeline.modeling.bert_config import bert_config
    from pipeline.modeling.param_groups import param_groups
    from pipeline.modeling.student import Student

    with torch.device("meta"):
        student = Student(BertForPreTraining(bert_config(model, vocab_size=VOCAB)))
    numel = {name: p.numel() for name, p in student.named_parameters()}
    order = _twin_order(model)
    assert sorted(order) == sorted(n for n in numel if uses_gradient(n, nsp=False)), "twin and model differ"
    groups = tuple(sum(p.numel() for p in g["params"]) for g in param_groups(student))
    return Layout(model, tuple((n, numel[n]) for n in order), groups, student.config)


def masked_per_sequence() -> int:
    return round(MASK_RATE * (SEQ_LEN - 2))  # [CLS] and [SEP] are never masked


def micro_flops(lay: Layout, micro: int) -> float:
    """Training FLOPs of one micro-batch of packed L = 128 blocks (docs/objectives.md)."""
    from pipeline.training.metrics import FlopsModel

    model = FlopsModel.of(lay.config, teacher=False)
    return model.batch_flops(
        tokens=micro * SEQ_LEN, sum_len_sq=micro * SEQ_LEN**2, masked=micro * masked_per_sequence()
    )


def backward_flops(lay: Layout, micro: int) -> list[float]:
    """Each parameter's share of the backward FLOPs (2/3 of the FLOPs model), in gradient order: an
    encoder layer's GEMMs by size plus its attention scores spread over its parameters; the head's
    transform; the vocabulary projection, which runs first (its weight is the tied word embedding,
    whose gradient is complete last), on the projection's bias; nothing for the embedding lookups."""
    from pipeline.modeling.bert_config import non_embedding_params

    cfg = lay.config
    D, V, n_layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    T, sq, M = micro * SEQ_LEN, micro * SEQ_LEN**2, micro * masked_per_sequence()
    per_layer = non_embedding_params(cfg)[0] / n_layers
    out = []
    for name, k in lay.ready:
        parts = name.split(".")
        if "layer" in parts:
            f = 6 * k * T + 12 * D * sq * k / per_layer
        elif "transform" in parts:
            f = 6 * k * M
        elif parts[-2:] == ["predictions", "bias"]:
            f = 6 * D * V * M
        else:
            f = 0.0
        out.append(f * 2 / 3)
    return out


def micro_batch(
    lay: Layout, *, world: int, micro: int, bucket: float, comm_bytes: int, cluster: Cluster, device: Device
) -> dict[str, float]:
    """One micro-batch (seconds): its compute, the waits of backward on the previous bucket's
    all-reduce, the last bucket's all-reduce after backward (the tail), the buckets, the whole."""
    rate = device.flops_per_s
    flops = backward_flops(lay, micro)
    t = stall = comm_free = 0.0  # t: the compute stream's clock since backward began
    filled = buckets = 0
    for (_, k), f in zip(lay.ready, flops):
        t += f / rate
        if filled and filled + k > bucket:
            wait = max(0.0, comm_free - t)  # DeepSpeed waits for the previous bucket's all-reduce
            stall, t = stall + wait, t + wait
            comm_free = t + cluster.seconds("all_reduce", filled * comm_bytes, world=world)
            filled, buckets = 0, buckets + 1
        filled += k
    wait = max(0.0, comm_free - t)
    stall, t = stall + wait, t + wait
    tail = cluster.seconds("all_reduce", filled * comm_bytes, world=world)
    forward = micro_flops(lay, micro) / 3 / rate
    return {
        "compute": forward + sum(flops) / rate,
        "stall": stall,
        "tail": tail,
        "buckets": buckets + 1,
        "time": forward + t + tail,
        "all_reduce_total": cluster.seconds("all_reduce", lay.grad_numel * comm_bytes, world=world),
    }


def step(
    lay: Layout,
    *,
    world: int,
    micro: int,
    accum: int = 1,
    bucket: float = BUCKET,
    comm_bytes: int = 2,
    cluster: Cluster = Cluster(),
    device: Device = Device(),
) -> dict[str, float]:
    """One optimizer step (seconds): `accum` micro-batches, the gradient-norm all-reduces and the bf16
    parameter all-gather; the scaling efficiency is compute / time."""
    m = micro_batch(lay, world=world, micro=micro, bucket=bucket, comm_bytes=comm_bytes, cluster=cluster, device=device)
    norm = len(lay.groups) * cluster.seconds("all_reduce", NORM_BYTES, world=world)
    gather = sum(
        cluster.seconds("all_gather_into_tensor", 2 * padded_numel(n, world=world), world=world) for n in lay.groups
    )
    time = accum * m["time"] + norm + gather
    compute = accum * m["compute"]
    return {
        **{k: m[k] for k in ("stall", "tail", "buckets", "all_reduce_total")},
        "compute": compute,
        "all_gather": gather,
        "exposed": time - compute,
        "time": time,
        "efficiency": compute / time,
    }


def smallest_micro(lay: Layout, *, world: int, target: float, **kw: Any) -> Optional[int]:
    """The smallest micro-batch per GPU (accumulation 1) whose step reaches `target` efficiency."""
    for micro in range(1, 4097):
        if step(lay, world=world, micro=micro, **kw)["efficiency"] >= target:
            return micro
    return None


# ---------------------------------------------------------------------------------------------------
# The page's tables
# ---------------------------------------------------------------------------------------------------

SLOW = Cluster(nvlink_busbw=250e9, nic_busbw=20e9, latency_fabric=150e-6)  # a pessimistic fabric


def bytes_rows() -> list[dict[str, Any]]:
    """Per model and world size: the formula's payloads and what one rank sends (ring), in bf16."""
    rows = []
    for model in MODELS:
        lay = layout(model)
        for world in WORLDS:
            terms = zero2_step_bytes(
                group_numels=lay.groups, grad_numel=lay.grad_numel, world=world, accum=1, comm_bytes=2, param_bytes=2
            )
            grads = terms["all_reduce"]["gradient_buckets"]
            params = terms["all_gather_into_tensor"]["parameters"]
            rows.append(
                {
                    "model": model,
                    "world": world,
                    "grad_numel": lay.grad_numel,
                    "all_reduce_payload_per_micro_batch": grads,
                    "all_reduce_sent_per_micro_batch": ring_bytes_sent("all_reduce", grads, world=world),
                    "all_gather_payload_per_step": params,
                    "all_gather_sent_per_step": ring_bytes_sent("all_gather_into_tensor", params, world=world),
                }
            )
    return rows


def time_rows(*, micro: int = 128, bucket: float = BUCKET) -> list[dict[str, Any]]:
    """Per model and world size at `micro` sequences per GPU: the step's parts (seconds) and its
    efficiency at accumulation 1 and 2, with bf16 and with fp32 gradient communication."""
    rows = []
    for model in MODELS:
        lay = layout(model)
        for world in WORLDS:
            one, two = (step(lay, world=world, micro=micro, accum=k, bucket=bucket) for k in (1, 2))
            fp32 = step(lay, world=world, micro=micro, accum=2, bucket=bucket, comm_bytes=4)
            rows.append(
                {
                    "model": model,
                    "world": world,
                    "busbw": Cluster().busbw(world),
                    **{k: one[k] for k in ("compute", "all_reduce_total", "stall", "tail", "all_gather", "buckets")},
                    "efficiency_accum1": one["efficiency"],
                    "efficiency_accum2": two["efficiency"],
                    "efficiency_accum2_fp32_comm": fp32["efficiency"],
                }
            )
    return rows


def batch_rows(*, bucket: float = BUCKET) -> list[dict[str, Any]]:
    """Per model and world size: the smallest micro-batch (accumulation 1) and global batch at which
    the step reaches 90% and 95% efficiency."""
    rows = []
    for model in MODELS:
        lay = layout(model)
        for world in WORLDS:
            row: dict[str, Any] = {"model": model, "world": world}
            for target in (0.90, 0.95):
                micro = smallest_micro(lay, world=world, target=target, bucket=bucket)
                row[f"micro_{round(target * 100)}"] = micro
                row[f"global_{round(target * 100)}"] = micro * world if micro else None
            rows.append(row)
    return rows


def bucket_rows(*, world: int = 64, micro: int = 128, accum: int = 2) -> list[dict[str, Any]]:
    """Exposed communication per step (seconds) for each reduce_bucket_size candidate, on the assumed
    fabric and on a pessimistic one (SLOW)."""
    rows = []
    for model in MODELS:
        lay = layout(model)
        for name, cluster in (("assumed", Cluster()), ("slow", SLOW)):
            exposed = {
                b: step(lay, world=world, micro=micro, accum=accum, bucket=b, cluster=cluster)["exposed"]
                for b in BUCKETS
            }
            rows.append({"model": model, "fabric": name, "exposed": exposed})
    return rows


def _mb(x: float) -> str:
    return f"{x / 1e6:,.0f} MB"


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def _elements(x: float) -> str:
    return f"{x:g}".replace("e+0", "e")  # 2.5e+07 -> 2.5e7


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def markdown_tables() -> dict[str, str]:
    """The page's four tables, by name (docs/scaling.md holds each between `<!-- comm_model:NAME -->`
    and `<!-- /comm_model:NAME -->`)."""
    name = {"base": "BERT-base", "large": "BERT-large"}
    out = {}
    out["bytes"] = _table(
        ["model", "R", "trained parameters", "gradient all-reduce per micro-batch: payload / one rank sends",
         "parameter all-gather per step: payload / one rank sends"],
        [[name[r["model"]], str(r["world"]), f"{r['grad_numel'] / 1e6:.1f} M",
          f"{_mb(r['all_reduce_payload_per_micro_batch'])} / {_mb(r['all_reduce_sent_per_micro_batch'])}",
          f"{_mb(r['all_gather_payload_per_step'])} / {_mb(r['all_gather_sent_per_step'])}"] for r in bytes_rows()],
    )  # fmt: skip
    out["times"] = _table(
        ["model", "R", "busbw", "compute per micro-batch (ms)", "gradient all-reduces (ms)",
         "exposed per micro-batch: waits + last bucket (ms)", "all-gather per step (ms)", "efficiency 128 x 1",
         "128 x 2", "128 x 2, fp32 gradients"],
        [[name[r["model"]], str(r["world"]), f"{r['busbw'] / 1e9:.0f} GB/s", _ms(r["compute"]),
          _ms(r["all_reduce_total"]), f"{_ms(r['stall'])} + {_ms(r['tail'])}", _ms(r["all_gather"]),
          _pct(r["efficiency_accum1"]), _pct(r["efficiency_accum2"]), _pct(r["efficiency_accum2_fp32_comm"])]
         for r in time_rows()],
    )  # fmt: skip
    out["batch"] = _table(
        ["model", "R", "90%: micro-batch / global batch", "95%: micro-batch / global batch"],
        [[name[r["model"]], str(r["world"]), f"{r['micro_90']} / {r['global_90']:,}",
          f"{r['micro_95']} / {r['global_95']:,}"] for r in batch_rows()],
    )  # fmt: skip
    out["buckets"] = _table(
        ["model", "fabric", *(_elements(b) for b in BUCKETS)],
        [[name[r["model"]], r["fabric"], *(_ms(r["exposed"][b]) for b in BUCKETS)] for r in bucket_rows()],
    )  # fmt: skip
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--markdown", action="store_true", help="print the page's tables instead of JSON")
    a = p.parse_args(argv)
    if a.markdown:
        for table_name, table in markdown_tables().items():
            print(f"<!-- comm_model:{table_name} -->\n{table}\n<!-- /comm_model:{table_name} -->\n")
        return 0
    report = {
        "model": "estimates, not measurements",
        "cluster": vars(Cluster()),
        "slow_cluster": vars(SLOW),
        "device": vars(Device()),
        "seq_len": SEQ_LEN,
        "reduce_bucket_size": BUCKET,
        "bytes": bytes_rows(),
        "times_micro_128": time_rows(),
        "smallest_batch": batch_rows(),
        "buckets_64_gpus_128x2": [
            {**r, "exposed": {_elements(b): v for b, v in r["exposed"].items()}} for r in bucket_rows()
        ],
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
