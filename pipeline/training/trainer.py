"""The training run: the DeepSpeed engine around the student, the TaCL teacher beside it, the
streaming loader, the loop, checkpoints, metrics and pre-emption.

`train(prepare(cfg))` (pipeline.training.preflight checks everything first). Each optimizer step is
pipeline.training.step.train_step, the same function the benchmarks time.

With the data loader's state in the checkpoint, a resumed run sees the same samples and computes the
same losses as the uninterrupted one (pipeline.training.step draws everything from seed, step, rank
and sample id; the RNG states are saved too, for anything else that draws).

The step reads nothing back from the device; every rank takes the decisions that need agreement (stop
at a pre-emption signal, abort after --max_nonfinite in a row) together at control steps
(--control_every and every log step), with one small collective of host numbers.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from pipeline import distributed, objectives
from pipeline.data.collator import MaskingCollator
from pipeline.data.loader import build_loader, loader_workers, shutdown_loader
from pipeline.data.masking import MaskingSpec
from pipeline.data.shards import run_key
from pipeline.hardware import slow_bf16_reason
from pipeline.modeling.encoder import Encoder
from pipeline.modeling.teacher import build_teacher, check_teacher, fingerprint
from pipeline.training import checkpoint, log, state
from pipeline.training.budget import TimeBudget
from pipeline.training.config import RECORD_KEYS
from pipeline.training.ds_config import client_scheduler
from pipeline.training.evaluation import Evaluator
from pipeline.training.metrics import FlopsModel, Meter, MetricsWriter, device_peak_flops, memory_gb, progress_bar
from pipeline.training.nonfinite import NonfiniteGuard
from pipeline.training.preflight import Prepared
from pipeline.training.state import TrainState
from pipeline.training.step import Batches, LossHook, StepProgram, to_device, train_step


class PreemptionFlag:
    """Records SIGUSR1 / SIGTERM; the loop acts on it at the next step boundary, on every rank."""

    def __init__(self) -> None:
        self.usr1 = False
        self.term = False

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def ignore_further(self) -> None:
        """Copies of a pre-emption signal reach Slurm's nodes seconds apart: a late one must not kill
        a rank that has already saved and is exiting (Python restores SIG_DFL at exit; SIG_IGN stays)."""
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGUSR1:
            self.usr1 = True
        else:
            self.term = True


def build_student(prep: Prepared, *, compile: bool = False):
    """The student (from scratch with the run's seed, or --init_from) and the lines to report."""
    from transformers import BertForPreTraining

    from pipeline.modeling.student import Student, load_pretrained

    torch.manual_seed(prep.cfg.run.seed)
    if prep.cfg.model.continue_from:
        from pipeline.training.hf_export import load_student
        from pipeline.training.preflight import phase_source

        path = phase_source(prep.cfg.model.continue_from)[1]
        net, _ = load_student(path)
        net.config.attention_probs_dropout_prob = prep.bert_config.attention_probs_dropout_prob
        net.train()
        lines = [f"phase {prep.phase['index']}: the weights of {path} (after {prep.phase['steps_before']} steps)"]
    elif prep.cfg.model.init_from:
        net, report = load_pretrained(prep.cfg.model.init_from, config=prep.bert_config)
        lines = report.lines()
    else:
        net = BertForPreTraining(prep.bert_config)
        lines = [
            f"model {prep.cfg.model.model_config}: {sum(p.numel() for p in net.parameters()) / 1e6:.2f}M parameters"
        ]
    return Student(net, full_head=prep.cfg.model.mlm_head == "full", compile=compile), lines


def engine_dtype(engine: Any) -> torch.dtype:
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


@dataclass
class Run:
    """Everything the loop works with: the step's program (engine, objective, teacher, guard), the run's
    state, the loader, and what the engine resolved."""

    prep: Prepared
    program: StepProgram
    state: TrainState
    teacher_print: Optional[str]  # TaCL's teacher's fingerprint, checked at every save and resume
    loader: Any
    dtype: torch.dtype
    micro: int
    resolved: dict[str, Any]
    peak: Optional[float]
    last_batch: Optional[dict[str, torch.Tensor]] = field(default=None, repr=False)
    evaluator: Optional[Evaluator] = None  # held-out evaluation (pipeline.training.evaluation), if any
    best: Optional[float] = None  # --keep_best: the lowest eval/mlm_loss of a kept checkpoint

    @property
    def engine(self) -> Any:
        return self.program.engine

    @property
    def device(self) -> torch.device:
        return self.program.device

    @property
    def save_dir(self) -> Path:
        return Path(self.prep.cfg.run.save_dir)


def setup(prep: Prepared, *, batches: Optional[Any] = None, hooks: Sequence[LossHook] = ()) -> Run:
    """Process group, student, teacher, engine, loader; resumes from the latest checkpoint if asked.
    `batches`: an iterable of collated batches to use instead of the streaming loader. `hooks`: loss
    hooks for the step (tests' fault injection; pipeline.training.step)."""
    cfg = prep.cfg
    program, teacher_print = _build_program(prep, hooks=hooks)
    engine, device = program.engine, program.device
    dtype, micro = engine_dtype(engine), engine.train_micro_batch_size_per_gpu()
    run = Run(
        prep=prep,
        program=program,
        state=TrainState(),
        teacher_print=teacher_print,
        loader=_loader(prep, micro=micro, device=device) if batches is None else batches,
        dtype=dtype,
        micro=micro,
        resolved={**cfg.to_dict(), **_record(prep, micro=micro, accum=program.accum, dtype=dtype, device=device)},
        peak=device_peak_flops(device, dtype=dtype, override_tflops=cfg.run.peak_tflops),
    )
    _restore(run)
    run.evaluator = _evaluator(prep, program) if prep.eval_sets else None
    run.best = checkpoint.best_value(run.save_dir) if cfg.eval.keep_best else None
    if distributed.is_main():
        run.save_dir.mkdir(parents=True, exist_ok=True)
        (run.save_dir / "config.json").write_text(json.dumps(run.resolved, indent=2, default=str) + "\n")
    return run


def _build_program(prep: Prepared, *, hooks: Sequence[LossHook]) -> tuple[StepProgram, Optional[str]]:
    """Process group, student, teacher and engine: the step's program, and the teacher's fingerprint
    (None without a teacher)."""
    cfg = prep.cfg
    objective = objectives.get(cfg.objective.objective)
    gpu = _start_process_group(prep)
    for note in cfg.notes + prep.resume_notes:
        log.info(note)
    compile_encoder = cfg.model.compile == "on" or (cfg.model.compile == "auto" and gpu is not None)
    student, init_lines = build_student(prep, compile=compile_encoder)
    for line in init_lines:
        log.info(line)
    # The teacher is the student's *initial* encoder: copy it before the engine trains or casts it.
    teacher = None
    if objective.needs_teacher:
        teacher = build_teacher(student, dtype=torch.float32, device=torch.device("cpu"))
    engine = _engine(prep, student)
    dtype, device = engine_dtype(engine), engine.device
    if teacher is not None:
        teacher = teacher.to(device=device, dtype=dtype)
        check_teacher(teacher, student)
    guard = NonfiniteGuard(device)
    guard.install(engine.module)
    program = StepProgram(
        engine=engine,
        objective=objective,
        args=cfg.objective,
        nsp=prep.use_nsp,
        teacher=Encoder(teacher, compile=compile_encoder) if teacher is not None else None,
        guard=guard,
        flops=FlopsModel.of(student.config, teacher=teacher is not None),
        device=device,
        seed=cfg.run.seed,
        accum=engine.gradient_accumulation_steps(),
        full_head=cfg.model.mlm_head == "full",
        trace=cfg.run.trace_samples,
        hooks=tuple(hooks),
    )
    return program, fingerprint(teacher) if teacher is not None else None


def _restore(run: Run) -> None:
    """A new phase (--continue_from) loads the optimizer state it continues; a resumed run, the latest
    checkpoint's engine, loader and state."""
    prep, m = run.prep, run.prep.cfg.model
    if prep.resume_from is None and m.continue_from:
        _start_phase(prep, run.engine)
    if prep.resume_from is not None:
        source = f"--init_from {m.init_from}" if m.init_from else f"--model_config {m.model_config}"
        state.resume(
            run.state,
            prep.resume_from[1],
            engine=run.engine,
            loader=run.loader,
            teacher_print=run.teacher_print,
            source=source,
        )
    run.state.skipped_at_start = run.state.skipped


def _start_phase(prep: Prepared, engine: Any) -> None:
    """A new phase (--continue_from): the optimizer state of the checkpoint it continues, not its
    schedule, step or data position (this run's own start at step 0)."""
    from pipeline.training.preflight import phase_source

    path = phase_source(prep.cfg.model.continue_from)[1]
    checkpoint.load(engine, path, scheduler=False)
    log.info(
        f"phase {prep.phase['index']}: continuing from {path} (weights and optimizer state; this run's data and "
        f"schedule from step 0; {prep.phase['steps_before']} steps before it)"
    )


def _evaluator(prep: Prepared, program: StepProgram) -> Evaluator:
    e = prep.cfg.eval
    evaluator = Evaluator(
        program,
        sets=prep.eval_sets,
        collator=make_collator(prep),
        vocab_size=len(prep.tokenizer),
        samples=e.eval_samples,
        run_id=run_key(prep.cfg.run.save_dir) + "-eval",
    )
    several = len(evaluator.sets) > 1
    parts = [
        f"{held.samples} samples of {', '.join(s.remote or s.local for s in prep.eval_sets[held.name].sources)}"
        + (f" (eval/{held.name}/)" if several else "")
        + f" ({held.batches} micro-batches of {held.micro} per rank)"
        for held in evaluator.sets
    ]
    log.info(f"held-out evaluation every {e.eval_every} steps and at the end: {'; '.join(parts)}")
    return evaluator


def _start_process_group(prep: Prepared) -> Optional[torch.device]:
    """This rank's GPU (None on CPU), bound before the process group so that NCCL uses it."""
    cfg = prep.cfg
    distributed.normalize_launch_env()
    # The GPU first, so that NCCL binds this rank's (a Slurm task bound to one GPU sees only it).
    gpu = distributed.gpu_for_this_rank(timeout_s=cfg.run.dist_timeout_s)
    # Two ranks of a node on one GPU (a launcher that binds GPUs per socket): refused, naming them.
    distributed.check_one_gpu_per_rank(gpu, timeout_s=cfg.run.dist_timeout_s)
    if gpu is not None:
        torch.cuda.set_device(gpu)
    distributed.bound_new_group_timeouts(timeout_s=cfg.run.dist_timeout_s)
    distributed.init_process_group(backend=distributed.default_backend(), timeout_s=cfg.run.dist_timeout_s, device=gpu)
    log.every_rank(
        f"rank {distributed.rank()} of world_size {distributed.world_size()} (local_rank "
        f"{distributed.local_rank()}, host {distributed.hostname()})"
    )
    if gpu is None and "OMP_NUM_THREADS" not in os.environ:
        # Ranks sharing a CPU would each start a thread per core and thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // distributed.local_world_size()))
    return gpu


def _engine(prep: Prepared, student: torch.nn.Module) -> Any:
    """The DeepSpeed engine around the student, with the run's schedule; warns once where bf16 is slow."""
    import deepspeed

    from pipeline.modeling.param_groups import param_groups

    ds, lr_scheduler = client_scheduler(prep.ds_config, schedule=prep.cfg.schedule)
    engine, _, _, _ = deepspeed.initialize(
        model=student, model_parameters=param_groups(student), config=ds, lr_scheduler=lr_scheduler
    )
    # Batch and precision as the engine resolved them (the JSON is their only owner).
    if engine_dtype(engine) == torch.bfloat16 and (why := slow_bf16_reason(engine.device)):
        # The JSON owns precision, so the run keeps bf16; it says once what that costs here.
        log.warning(
            f"bf16 on {engine.device}: {why}. For a CPU run set bf16.enabled to false in "
            f"--ds_config {prep.cfg.run.ds_config} (deepspeed_configs/demo.json is an fp32 config)"
        )
    return engine


def _loader(prep: Prepared, *, micro: int, device: torch.device) -> Any:
    cfg = prep.cfg
    return build_loader(
        prep.data,
        weights=cfg.data.data_weights,
        micro_batch=micro,
        collator=make_collator(prep),
        vocab_size=len(prep.tokenizer),
        seed=cfg.run.seed,
        num_workers=loader_workers(cfg.data.num_workers, say=log.info),
        num_canonical_nodes=cfg.data.num_canonical_nodes,
        run_id=run_key(cfg.run.save_dir),
        pin_memory=device.type == "cuda",
        timeout_s=cfg.run.dist_timeout_s,
    )


def _record(prep: Prepared, *, micro: int, accum: int, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """The facts of the run that RUN/config.json records beside its settings (RECORD_KEYS)."""
    world = distributed.world_size()
    record = {
        "deepspeed": prep.ds_config,
        "engine": {
            "micro_batch_per_rank": micro,
            "gradient_accumulation_steps": accum,
            "world_size": world,
            "global_batch": micro * accum * world,
            "dtype": str(dtype).replace("torch.", ""),
            "device": str(device),
        },
        "data_format": prep.data.format,
        "nsp": prep.use_nsp,
        "tokenizer": prep.tokenizer_dir,
        "max_seq_len": prep.data.max_seq_len,
        "samples": prep.data.samples,
        "bert_config": prep.bert_config.to_dict(),
        "identity": prep.identity,
        "phase": prep.phase,
    }
    assert tuple(record) == RECORD_KEYS, (tuple(record), RECORD_KEYS)
    return record


def make_collator(prep: Prepared) -> MaskingCollator:
    """The masking collator of a job: its tokenizer's specials, the data's NSP labels and length."""
    cfg, tok = prep.cfg, prep.tokenizer
    spec = MaskingSpec(
        mask_token_id=tok.mask_token_id,
        special_ids=tuple(sorted(set(tok.all_special_ids))),
        vocab_size=len(tok),
        mask_prob=cfg.data.mask_prob,
        whole_word=cfg.data.whole_word_masking,
    )
    return MaskingCollator(
        spec=spec,
        pad_id=tok.pad_token_id,
        seed=cfg.run.seed,
        nsp=prep.use_nsp,
        max_seq_len=prep.data.max_seq_len or prep.bert_config.max_position_embeddings,
        padding=cfg.data.nsp_padding,
        document_sep_id=tok.sep_token_id
        if prep.data.format == "packed" and cfg.data.packed_attention == "document"
        else None,
    )


def control(run: Run, flag: PreemptionFlag) -> Optional[str]:
    """The decisions every rank takes together (one small collective of host numbers; one device read
    of the guard's counters): returns the pre-emption signal to stop for, or None. Raises when the
    loss was non-finite --max_nonfinite micro-batches in a row on some rank."""
    rows = distributed.all_gather_ints([int(flag.usr1), int(flag.term), *run.program.guard.read()])
    usr1, term, worst, last_step = (max(r[i] for r in rows) for i in range(4))
    skipped = run.state.skipped_at_start + sum(r[4] for r in rows)
    if skipped > run.state.skipped:
        log.warning(
            f"non-finite loss at step {last_step}: micro-batch neutralised ({skipped - run.state.skipped} since "
            f"the last check, {worst} in a row at most)"
        )
        run.state.skipped = skipped
    limit, cfg_lr = run.prep.cfg.run.max_nonfinite, run.prep.cfg.schedule.lr
    if worst >= limit:
        raise RuntimeError(
            f"loss was NaN/inf for {worst} micro-batches in a row, the last at step {last_step}: "
            f"stopping (--max_nonfinite {limit}). {checkpoint.fallback_advice(run.save_dir, lr=cfg_lr)}"
        )
    return "SIGUSR1" if usr1 else "SIGTERM" if term else None


def log_record(run: Run, meter: Meter, *, lr: float) -> dict[str, Any]:
    """The metrics line of the interval since the last one (a collective: every rank calls it)."""
    vals, elapsed, steps = meter.reduce()
    keys = meter.keys
    mem, mem_kind = memory_gb(run.device)
    grad_norm = run.engine.get_global_grad_norm()
    flops_per_s = vals["flops"] / elapsed
    phase = run.prep.phase
    return {
        "step": run.state.step,
        "phase": phase["index"],
        "global_step": phase["steps_before"] + run.state.step,  # across the phases of a training
        **{k: vals[k] for k in keys},
        "lr": lr,
        "grad_norm": meter.grad_norm(grad_norm),  # NaN (null in metrics.jsonl) for a step skipped whole
        "loss_scale": float(getattr(run.engine.optimizer, "loss_scale", 1.0)),
        "tokens_per_s": vals["tokens"] / elapsed,
        "samples_per_s": vals["samples"] / elapsed,
        "tflops_per_s": flops_per_s / 1e12,
        "mfu": flops_per_s / (run.peak * distributed.world_size()) if run.peak else None,
        "step_time_s": elapsed / max(steps, 1),
        "mem_gb": mem,
        "mem_kind": mem_kind,
        "skipped_micro_batches": run.state.skipped,
        # fp16's dynamic loss scaling skips the optimizer step on overflow (DeepSpeed counts them).
        "overflow_steps": int(getattr(run.engine, "skipped_steps", 0)),
        "time": time.time(),
    }


def train(prep: Prepared, *, hooks: Sequence[LossHook] = ()) -> int:
    """Run the job on every rank. Returns the exit code: 0 when done, and 0 after a pre-emption
    signal or --stop_after_step once the checkpoint is saved. `hooks`: see `setup`."""
    cfg = prep.cfg
    flag = PreemptionFlag()
    flag.install()
    run = writer = bar = None
    try:
        run = setup(prep, hooks=hooks)
        writer = MetricsWriter(
            run.save_dir,
            enabled=distributed.is_main(),
            resume_step=run.state.step,
            trace=cfg.run.trace_samples,
            report_to=cfg.run.report_to,
            run_config=run.resolved,
            new_run=cfg.run.resume == "none",
        )
        show_bar = cfg.run.progress_bar == "on" or (cfg.run.progress_bar == "auto" and sys.stderr.isatty())
        bar = progress_bar(
            enabled=distributed.is_main() and show_bar, total=cfg.schedule.max_steps, initial=run.state.step
        )
        stopped = loop(run, flag, writer=writer, bar=bar)
        if stopped is None:
            finish(run)
        return 0
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close(failed=sys.exc_info()[0] is not None)  # in a finally: the exception on its way out
        if run is not None:
            shutdown_loader(run.loader)
        distributed.release_deepspeed_shm()
        flag.ignore_further()


@dataclass(frozen=True)
class Due:
    """What the step just taken calls for (pipeline.training.config's intervals)."""

    last: bool  # --max_steps (or the --max_time budget's step): the run ends here, whatever else asks it to stop
    log: bool
    save: bool
    eval: bool
    chunk_end: bool  # --stop_after_step
    control: bool  # the ranks agree on pre-emption and the non-finite limit

    @classmethod
    def at(cls, run: Run, *, total: int) -> Due:
        cfg, step = run.prep.cfg, run.state.step
        last = step >= total
        every = cfg.eval.eval_every
        ev = run.evaluator is not None and (step % every == 0 or last)
        log_, save_ = step % cfg.run.log_every == 0 or last, step % cfg.run.save_every == 0 or last
        chunk_end = step == cfg.run.stop_after_step and not last
        control_ = log_ or save_ or ev or chunk_end or step % cfg.run.control_every == 0
        return cls(last=last, log=log_, save=save_, eval=ev, chunk_end=chunk_end, control=control_)


def loop(run: Run, flag: PreemptionFlag, *, writer: MetricsWriter, bar: Any) -> Optional[str]:
    """Train to max_steps (or the step the --max_time budget fits). Returns None when done, else why it
    stopped early (after saving)."""
    cfg = run.prep.cfg
    batches, meter = Batches(run.loader), Meter(run.program.objective.metric_keys(nsp=run.program.nsp), run.device)
    run.engine.train()
    st = run.state
    end = TimeBudget(
        max_time_s=cfg.schedule.max_time,
        max_steps=cfg.schedule.max_steps,
        state=st,
        scheduler=run.engine.lr_scheduler,
        every=cfg.run.control_every,
    )
    while st.step < end.total:
        end.start_step()
        res = train_step(run.program, st, batches, meter)
        end.end_step()  # the budget's time; every rank re-fits the total at the same steps
        run.last_batch = res.last_batch
        if bar is not None:
            bar.update(1)
        if cfg.run.trace_samples:
            writer.trace(st.step, distributed.all_gather_object(res.sample_ids))
        due = Due.at(run, total=end.total)
        signal_name = control(run, flag) if due.control else None
        signalled = signal_name is not None and not due.last  # at the end the run simply ends
        stopping = signalled or due.chunk_end
        fields = evaluate(run, meter, last=due.last) if due.eval else {}
        if due.log or stopping or fields:
            record = {**log_record(run, meter, lr=res.lr), **fields}
            writer.log(record)
            if bar is not None:
                bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        best = _improves(run, fields)
        if due.save or stopping or best:
            t0 = time.perf_counter()
            save(run)
            meter.exclude(time.perf_counter() - t0)  # throughput counts training, not checkpoints
        if best:
            _keep_best(run, fields["eval/mlm_loss"])
        if signalled:
            log.info(f"pre-emption signal {signal_name}: saved checkpoint at step {st.step}, exiting 0")
            return signal_name
        if due.chunk_end:
            log.info(f"stopped after step {st.step} (--stop_after_step): saved checkpoint, exiting 0")
            return "--stop_after_step"
    return None  # at the end, saved (or resumed there: nothing left to train)


def evaluate(run: Run, meter: Meter, *, last: bool) -> dict[str, Any]:
    """The held-out evaluation's fields of this step's metrics line (a collective); its time is not
    counted as training time. Every --eval_health_every-th evaluation, and the last, adds the health
    figures."""
    k = run.prep.cfg.eval.eval_health_every
    health = bool(k) and ((run.evaluator.done + 1) % k == 0 or last)
    fields = run.evaluator(health=health)
    meter.exclude(fields["eval/time_s"])
    return fields


def _improves(run: Run, fields: dict[str, Any]) -> bool:
    loss = fields.get("eval/mlm_loss")
    return run.prep.cfg.eval.keep_best and loss is not None and (run.best is None or loss < run.best)


def _keep_best(run: Run, loss: float) -> None:
    run.best = loss
    if distributed.is_main():
        checkpoint.mark_best(run.save_dir, step=run.state.step, value=loss)
        log.info(f"best held-out MLM loss so far ({loss:.4f}): {checkpoint.checkpoints_dir(run.save_dir)}/best")
    distributed.barrier()


def save(run: Run) -> Path:
    """A checkpoint of the run at its step (every rank: a collective)."""
    return state.save(
        run.state,
        engine=run.engine,
        loader=run.loader,
        teacher=run.program.teacher,
        teacher_print=run.teacher_print,
        resolved=run.resolved,
        tokenizer=run.prep.tokenizer,
        save_dir=run.save_dir,
        keep=run.prep.cfg.run.keep_checkpoints,
    )


def finish(run: Run) -> None:
    """Export (rank 0, checked against the engine's logits) and the closing line."""
    cfg = run.prep.cfg
    if cfg.run.export_dir and distributed.is_main():
        from pipeline.training.hf_export import export, verify_export

        export(checkpoint.latest_checkpoint(run.save_dir)[1], cfg.run.export_dir)
        batch = run.last_batch
        if batch is None:  # nothing trained in this process (resumed at max_steps)
            batch = to_device(next(iter(run.loader)), run.device)
        check = verify_export(
            run.engine.module.net, cfg.run.export_dir, batch=batch, dtype=run.dtype, out=run.save_dir / "export_check"
        )
        log.info(
            f"exported the student to {cfg.run.export_dir} (logits vs the engine: max |diff| "
            f"{check['max_abs_diff_same_dtype']:.3g} in {check['dtype']}, {check['max_abs_diff_fp32']:.3g} in fp32)"
        )
    distributed.barrier()
    log.info(f"done: step {run.state.step}")
