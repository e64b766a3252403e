"""The training step in process (pipeline.training.step.train_step, no launcher): a tiny model, real
losses, real optimizer steps, through the bare engine (pipeline.bench.engine, the DeepSpeed engine's
numbers for one rank). Also: an objective is one thing that a test can register and train."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pipeline import objectives
from pipeline.bench.engine import BareEngine
from pipeline.modeling.param_groups import param_groups
from pipeline.modeling.student import Student
from pipeline.objectives import Defaults, Objective
from pipeline.training.config import ObjectiveArgs, parse_args
from pipeline.training.metrics import FlopsModel, Meter
from pipeline.training.nonfinite import NonfiniteGuard
from pipeline.training.state import TrainState
from pipeline.training.step import Batches, StepProgram, train_step
from preprocessing import cli
from tests.support.batches import collate, model

DS = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "bf16": {"enabled": False},
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 1e-3,
            "warmup_num_steps": 2,
            "total_num_steps": 10,
            "warmup_type": "linear",  # DeepSpeed's default is log
        },
    },
}


@dataclass
class SpreadKnobs:
    spread_weight: float = cli.knob(0.5, "the toy term's weight")


class Spread(Objective):
    """A toy objective: MLM + w x the mean squared norm of the last layer's real tokens (pulls them in)."""

    name = "toy_spread"
    help = "MLM + a toy term (tests)"
    defaults = Defaults(lr=3e-4, nsp="auto", warmup_ratio=0.2)
    term = "spread"
    knobs = SpreadKnobs

    def weight(self, args: Any) -> float:
        return getattr(args, "spread_weight", 0.5)

    def extra_term(self, out, batch, *, inputs):
        rows_TD = out["hidden"].flatten(0, 1).index_select(0, batch["grid_index"])
        loss = rows_TD.float().pow(2).sum(-1).mean()
        return loss, {"loss": loss.detach(), "acc": torch.zeros(())}


@pytest.fixture
def toy():
    objective = objectives.register(Spread())
    yield objective
    objectives.base._REGISTRY.pop(objective.name)


def program(
    objective: Objective, *, ds: dict = DS, seed: int = 0, args: Any = None
) -> tuple[StepProgram, torch.nn.Module]:
    torch.manual_seed(seed)
    student = Student(model())
    engine = BareEngine(student, ds=ds, param_groups=param_groups(student), device=torch.device("cpu"))
    guard = NonfiniteGuard(torch.device("cpu"))
    guard.install(student)
    p = StepProgram(
        engine=engine,
        objective=objective,
        args=args if args is not None else ObjectiveArgs(objective=objective.name),
        nsp=True,
        teacher=None,
        guard=guard,
        flops=FlopsModel.of(student.config, teacher=False),
        device=torch.device("cpu"),
        seed=seed,
        accum=engine.gradient_accumulation_steps(),
    )
    return p, student


def batches(n: int) -> list[dict]:
    return [collate([9, 14, 6, 11], seed=k) for k in range(n)]


def test_a_registered_objective_is_configured_and_trained(toy):
    cfg = parse_args(
        ["--ds_config", "x.json", "--objective", toy.name, "--data", "d", "--model_config", "tiny"]
        + ["--max_steps", "50", "--save_dir", "r"]
    )
    assert (cfg.schedule.lr, cfg.schedule.warmup_steps, cfg.objective.nsp) == (3e-4, 10, "auto")  # its defaults
    assert toy.metric_keys(nsp=True) == [
        "loss",
        "mlm_loss",
        "mlm_acc",
        "nsp_loss",
        "nsp_acc",
        "spread_loss",
        "spread_acc",
    ]
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 1}}

    def spread_after(weight: float, steps: int = 12) -> list[dict[str, float]]:
        args = ObjectiveArgs(objective=toy.name)
        args.spread_weight = weight
        p, _ = program(toy, ds={**DS, "scheduler": sched}, args=args)
        meter, state, data, out = Meter(toy.metric_keys(nsp=True), torch.device("cpu")), TrainState(), batches(2), []
        for _ in range(steps):  # the same two micro-batches every step
            train_step(p, state, Batches(data), meter)
            out.append(meter.reduce()[0])
        assert state.step == steps
        return out

    first, untrained = spread_after(5.0), spread_after(0.0)
    # Training on the term lowers it against the same run that only logs it.
    assert first[-1]["spread_loss"] < untrained[-1]["spread_loss"] - 1.0
    assert first[0]["spread_loss"] == pytest.approx(untrained[0]["spread_loss"])
    for v in first:
        assert v["loss"] == pytest.approx(v["mlm_loss"] + v["nsp_loss"] + 5.0 * v["spread_loss"], rel=1e-5)


def test_one_step_is_the_plain_torch_step_on_the_concatenated_micro_batches():
    """Two micro-batches of accumulation through the bare engine equal one plain AdamW step on their
    mean loss, with BERT's decay groups and clipping (the reference written out by hand)."""
    mlm = objectives.get("mlm")
    p, student = program(mlm)
    data = batches(2)
    train_step(p, TrainState(), Batches(data), Meter(mlm.metric_keys(nsp=True), torch.device("cpu")))
    torch.manual_seed(0)
    ref = Student(model())
    opt = torch.optim.AdamW(param_groups(ref), lr=0.0, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    lr_step0 = 0.0  # warm-up from warmup_min_lr 0 over 2 steps: the first step runs at lr 0 ...
    for g in opt.param_groups:
        g["lr"] = lr_step0
    loss = 0.0
    for micro, batch in enumerate(data):
        from pipeline.objectives import LossInputs
        from pipeline.training.step import mixed_seed

        torch.manual_seed(mixed_seed(0, 0, micro, 0))
        gen = torch.Generator().manual_seed(mixed_seed(0, 0, micro, 1 << 20))
        out = ref(batch, with_nsp=True)
        res = mlm.losses(
            out, batch, nsp=True, inputs=LossInputs(args=ObjectiveArgs(objective="mlm"), teacher=None, generator=gen)
        )
        loss = res.total / 2
        loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt.step()
    for (name, a), b in zip(student.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    # ... and the second at half the peak: the schedule is the JSON's.
    assert p.engine.get_lr()[0] == pytest.approx(0.5e-3)


def test_bf16_weights_keep_fp32_masters():
    ds = {**DS, "bf16": {"enabled": True}, "gradient_accumulation_steps": 1}
    mlm = objectives.get("mlm")
    p, student = program(mlm, ds=ds)
    assert all(w.dtype == torch.bfloat16 for w in student.parameters())
    state = TrainState()
    for _ in range(3):
        train_step(p, state, Batches(batches(1)), Meter(mlm.metric_keys(nsp=True), torch.device("cpu")))
    engine = p.engine
    for w, m in zip(engine.params, engine.masters):
        assert m.dtype == torch.float32 and torch.equal(w.float(), m.to(torch.bfloat16).float())
    assert any(bool((m.to(torch.bfloat16).float() != m).any()) for m in engine.masters)  # masters hold more bits
