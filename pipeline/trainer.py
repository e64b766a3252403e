"""The training loop: DeepSpeed ZeRO engine, student (+ TaCL teacher), streaming data, losses,
checkpoints, metrics, pre-emption.

`prepare(cfg)` does every check that needs no process group and no device (batch identity, data,
objective vs data, tokenizer vs model vs shards, sequence length, resume state), so bad input fails
in seconds. `train(prepared)` then runs the job and returns the exit code.

Determinism: every random draw is a function of (seed, step, micro-batch, rank, sample id):
masking per (seed, epoch, sample id) in the collator, dropout and the losses' draws re-seeded each
micro-batch. With the data loader's state in the checkpoint, a resumed run sees the same samples
and computes the same losses as the uninterrupted one.

Legend: B sequences per micro-batch, L positions, D hidden size, N masked positions.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from pipeline import checkpoint, distributed
from pipeline.config import TrainConfig, load_ds_json, resolve_ds_config
from pipeline.data import (DataInfo, MaskingCollator, build_loader, check_objective_against_data,
                           default_cache_root, inspect_data, run_key)
from pipeline.masking import MaskingSpec
from pipeline.metrics import FlopsModel, MetricsWriter, device_peak_flops, memory_gb, progress_bar

LOG = "[pipeline]"


def emit(msg: str) -> None:
    """One whole line on stdout in a single write, so that ranks sharing a log never interleave
    within a line (the Slurm tests grep these lines)."""
    sys.stdout.write(f"{LOG} {msg}\n")
    sys.stdout.flush()


def say(msg: str) -> None:
    """A line from rank 0."""
    if distributed.is_main():
        emit(msg)


@dataclass
class Prepared:
    """What `prepare` checked and resolved."""

    cfg: TrainConfig
    ds_config: dict[str, Any]
    data: DataInfo
    use_nsp: bool
    tokenizer: Any
    tokenizer_dir: str
    bert_config: Any
    world_size: int
    resume_from: Optional[tuple[int, Path]]


def prepare(cfg: TrainConfig) -> Prepared:
    """Every check that needs neither a process group nor a device. Raises ValueError naming the
    flag, file or value."""
    from transformers import AutoTokenizer, BertConfig

    from pipeline.model import bert_config, check_positions, check_vocab

    world = distributed.launch_world_size()
    ds = resolve_ds_config(load_ds_json(cfg.run.ds_config), schedule=cfg.schedule, world_size=world,
                           path=cfg.run.ds_config)
    cache_root = cfg.data.cache_dir or default_cache_root(cfg.run.save_dir)
    info = inspect_data(cfg.data.data, cache_root=cache_root, max_seq_len=cfg.data.max_seq_len)
    use_nsp = check_objective_against_data(cfg.objective.objective, nsp=cfg.objective.nsp, fmt=info.format,
                                           paths=cfg.data.data)
    tok_dir = cfg.model.tokenizer or info.tokenizer_dir
    if tok_dir is None and cfg.model.init_from and (Path(cfg.model.init_from) / "vocab.txt").is_file():
        tok_dir = cfg.model.init_from
    if tok_dir is None:
        raise ValueError("no tokenizer: pass --tokenizer DIR (the shards' own DATA/tokenizer was not found)")
    if not Path(tok_dir).is_dir():
        raise ValueError(f"--tokenizer {tok_dir}: no such folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    except Exception as e:  # transformers raises OSError/ValueError/... for unreadable folders
        raise ValueError(f"--tokenizer {tok_dir}: cannot load a tokenizer ({type(e).__name__}: {e})")
    for name in ("mask_token_id", "pad_token_id", "cls_token_id", "sep_token_id"):
        if getattr(tokenizer, name) is None:
            raise ValueError(f"--tokenizer {tok_dir}: no {name.replace('_id', '')}; a BERT tokenizer needs "
                             f"[PAD] [CLS] [SEP] [MASK]")
    if cfg.model.init_from:
        source = f"--init_from {cfg.model.init_from}"
        if not (Path(cfg.model.init_from) / "config.json").is_file():
            raise ValueError(f"--init_from {cfg.model.init_from}: no config.json; expected a Hugging Face BERT folder")
        bcfg = BertConfig.from_pretrained(cfg.model.init_from)
        if bcfg.model_type != "bert":
            raise ValueError(f"--init_from {cfg.model.init_from}: model_type {bcfg.model_type!r}, expected 'bert'")
    else:
        source = f"--model_config {cfg.model.model_config}"
        bcfg = bert_config(cfg.model.model_config, vocab_size=len(tokenizer))
    check_vocab(model_vocab=bcfg.vocab_size, tokenizer_size=len(tokenizer), tokenizer_dir=tok_dir,
                data_vocab=info.manifest_vocab_size, model_source=source)
    check_positions(max_seq_len=info.max_seq_len, config=bcfg, model_source=source)
    found = checkpoint.latest_checkpoint(cfg.run.save_dir)
    if found and cfg.run.resume == "none":
        raise ValueError(f"--save_dir {cfg.run.save_dir} already holds checkpoint {found[1].name}: pass --resume auto "
                         f"to continue it, or choose a new --save_dir")
    return Prepared(cfg=cfg, ds_config=ds, data=info, use_nsp=use_nsp, tokenizer=tokenizer, tokenizer_dir=tok_dir,
                    bert_config=bcfg, world_size=world, resume_from=found if cfg.run.resume == "auto" else None)


# ---------------------------------------------------------------------------------------------------
# Pieces of the run
# ---------------------------------------------------------------------------------------------------


def mixed_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of the parts (seed, step, micro-batch, rank, ...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


class PreemptionFlag:
    """Records SIGUSR1 / SIGTERM; the loop acts on it at the next step boundary, on every rank."""

    def __init__(self) -> None:
        self.usr1 = False
        self.term = False

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGUSR1:
            self.usr1 = True
        else:
            self.term = True


def build_student(prep: Prepared):
    """The student (from scratch with the run's seed, or --init_from) and the init report lines."""
    from transformers import BertForPreTraining

    from pipeline.model import Student, load_pretrained

    torch.manual_seed(prep.cfg.run.seed)
    if prep.cfg.model.init_from:
        net, report = load_pretrained(prep.cfg.model.init_from)
        lines = report.lines()
    else:
        net = BertForPreTraining(prep.bert_config)
        lines = [f"model {prep.cfg.model.model_config}: {sum(p.numel() for p in net.parameters()) / 1e6:.2f}M parameters"]
    return Student(net), lines


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Trainable parameters only; biases and LayerNorm weights get no weight decay (BERT's rule);
    the other group takes the weight decay of the DeepSpeed JSON."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.endswith(".bias") or "LayerNorm" in name else decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def engine_dtype(engine: Any) -> torch.dtype:
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


def rng_states() -> dict[str, Any]:
    import random

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_states(state: dict[str, Any]) -> None:
    import random

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class StepLosses:
    """One micro-batch's loss terms and metrics (detached fp32 scalars)."""

    total: torch.Tensor
    values: dict[str, torch.Tensor]


def compute_losses(prep: Prepared, out: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], *,
                   teacher: Optional[torch.nn.Module], generator: torch.Generator) -> StepLosses:
    """The objective's total loss for one micro-batch, and each term with its accuracy."""
    from pipeline import losses

    o = prep.cfg.objective
    total, mlm_m = losses.mlm_loss(out["mlm_logits"], batch["mlm_labels"])
    values = {"mlm_loss": mlm_m["loss"], "mlm_acc": mlm_m["acc"]}
    if prep.use_nsp:
        nsp, nsp_m = losses.nsp_loss(out["nsp_logits"], batch["nsp_labels"])
        total = total + nsp
        values.update(nsp_loss=nsp_m["loss"], nsp_acc=nsp_m["acc"])
    if o.objective == "tacl":
        with torch.no_grad():
            teacher_BLD = teacher(input_ids=batch["original_ids"], token_type_ids=batch["token_type_ids"],
                                  attention_mask=batch["attention_mask"]).last_hidden_state
        tacl, m = losses.tacl_loss(out["hidden"], teacher_BLD=teacher_BLD, masked_BL=batch["masked"],
                                   attention_mask_BL=batch["attention_mask"], temperature=o.tacl_temperature,
                                   negatives=o.tacl_negatives, num_pool=o.tacl_num_pool, generator=generator)
        total = total + tacl
        values.update(tacl_loss=m["loss"], tacl_acc=m["acc"])
    elif o.objective == "taco":
        tc, m = losses.taco_loss(out["hidden"], embeddings_BLD=out["embeddings"],
                                 attention_mask_BL=batch["attention_mask"], anchors=o.taco_anchors,
                                 masked_BL=batch["masked"], window=o.taco_window, num_negatives=o.taco_num_negatives,
                                 temperature=o.taco_temperature, detach=o.taco_detach, generator=generator)
        total = total + o.taco_lambda * tc
        values.update(tc_loss=m["loss"], tc_acc=m["acc"])
    values["loss"] = total.detach().float()
    return StepLosses(total=total, values=values)


class Meter:
    """Sums over the micro-batches of a logging interval; `reduce` averages losses and sums counts
    over ranks (one collective, called by every rank on the same steps)."""

    COUNTS = ("tokens", "samples", "flops")

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.micro = 0
        self.steps = 0
        self.t0 = time.perf_counter()

    def add(self, values: dict[str, torch.Tensor], *, tokens: int, samples: int, flops: float) -> None:
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)
        for k, v in (("tokens", tokens), ("samples", samples), ("flops", flops)):
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.micro += 1

    def reduce(self, keys: list[str]) -> tuple[dict[str, float], float]:
        elapsed = time.perf_counter() - self.t0
        local = torch.tensor([self.sums.get(k, 0.0) for k in keys] + [float(self.micro)], dtype=torch.float64)
        summed = distributed.sum_over_ranks(local).tolist()
        micro_all = max(summed[-1], 1.0)
        out = {k: (v if k in self.COUNTS else v / micro_all) for k, v in zip(keys, summed)}
        self.sums, self.micro, self.steps, self.t0 = {}, 0, 0, time.perf_counter()
        return out, elapsed


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------


def train(prep: Prepared) -> int:
    """Run the job described by `prep` on every rank. Returns the exit code (0 also after a
    pre-emption signal, once the checkpoint is saved)."""
    import deepspeed

    from pipeline.model import build_teacher, check_teacher, fingerprint

    cfg = prep.cfg
    flag = PreemptionFlag()
    flag.install()
    distributed.normalize_launch_env()
    distributed.init_process_group(backend=distributed.default_backend(), timeout_s=cfg.run.dist_timeout_s)
    local = distributed.local_rank()
    emit(f"rank {distributed.rank()} of world_size {distributed.world_size()} (local_rank {local}, "
         f"host {distributed.hostname()})")
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    elif "OMP_NUM_THREADS" not in os.environ:
        # Ranks sharing a CPU would each start a thread per core and thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // distributed.local_world_size()))
    for note in cfg.notes:
        say(note)

    student, init_lines = build_student(prep)
    for line in init_lines:
        say(line)
    teacher = build_teacher(student, dtype=torch.float32, device=torch.device("cpu")) \
        if cfg.objective.objective == "tacl" else None
    engine, _, _, _ = deepspeed.initialize(model=student, model_parameters=param_groups(student),
                                           config=prep.ds_config)
    # Batch and precision as the engine resolved them (the JSON is their only owner).
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dtype, device = engine_dtype(engine), engine.device
    if teacher is not None:
        teacher = teacher.to(device=device, dtype=dtype)
        check_teacher(teacher, student)
    teacher_print = fingerprint(teacher) if teacher is not None else None

    tok = prep.tokenizer
    spec = MaskingSpec(mask_token_id=tok.mask_token_id, special_ids=tuple(sorted(set(tok.all_special_ids))),
                       vocab_size=len(tok), mask_prob=cfg.data.mask_prob, whole_word=cfg.data.whole_word_masking)
    collator = MaskingCollator(spec=spec, pad_id=tok.pad_token_id, seed=cfg.run.seed, nsp=prep.use_nsp,
                               max_seq_len=prep.data.max_seq_len or prep.bert_config.max_position_embeddings)
    loader = build_loader(prep.data, weights=cfg.data.data_weights, micro_batch=micro, collator=collator,
                          vocab_size=len(tok), seed=cfg.run.seed, num_workers=cfg.data.num_workers,
                          num_canonical_nodes=cfg.data.num_canonical_nodes, run_id=run_key(cfg.run.save_dir),
                          pin_memory=device.type == "cuda")

    step, skipped_total = 0, 0
    if prep.resume_from is not None:
        client = checkpoint.load(engine, prep.resume_from[1])
        step, skipped_total = int(client["step"]), int(client.get("skipped_micro_batches", 0))
        loader.load_state_dict(client["loader"])
        if client.get("world_size") == distributed.world_size():
            set_rng_states(client["rng"][distributed.rank()])
        if teacher_print is not None and client.get("teacher_fingerprint") not in (None, teacher_print):
            raise ValueError(f"the TaCL teacher rebuilt from {cfg.model.init_from or 'the seed'} differs from the one "
                             f"this run started with; resume with the same --init_from/--model_config/--seed")
        say(f"resumed from {prep.resume_from[1]} at step {step}")

    save_dir = Path(cfg.run.save_dir)
    resolved = {**cfg.to_dict(), "deepspeed": prep.ds_config,
                "engine": {"micro_batch_per_rank": micro, "gradient_accumulation_steps": accum,
                           "world_size": distributed.world_size(), "global_batch": micro * accum * distributed.world_size(),
                           "dtype": str(dtype).replace("torch.", ""), "device": str(device)},
                "data_format": prep.data.format, "nsp": prep.use_nsp, "tokenizer": prep.tokenizer_dir,
                "max_seq_len": prep.data.max_seq_len, "samples": prep.data.samples,
                "model": prep.bert_config.to_dict()}
    if distributed.is_main():
        save_dir.mkdir(parents=True, exist_ok=True)
        (save_dir / "config.json").write_text(json.dumps(resolved, indent=2, default=str) + "\n")

    def write_extras(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        student.config.save_pretrained(folder)
        tok.save_pretrained(folder)

    def save(at: int) -> Path:
        client = {"step": at, "loader": loader.state_dict(), "skipped_micro_batches": skipped_total,
                  "rng": distributed.all_gather_object(rng_states()), "world_size": distributed.world_size(),
                  "teacher_fingerprint": teacher_print, "config": resolved}
        return checkpoint.save(engine, save_dir=save_dir, step=at, client_state=client,
                               keep=cfg.run.keep_checkpoints, write_extras=write_extras)

    from pipeline.model import non_embedding_params

    layer_params, head_params = non_embedding_params(student.config)
    flops_model = FlopsModel(layer_params=layer_params, head_params=head_params,
                             n_layers=student.config.num_hidden_layers, hidden=student.config.hidden_size,
                             vocab=student.config.vocab_size, teacher=teacher is not None)
    peak = device_peak_flops(device, dtype=dtype, override_tflops=cfg.run.peak_tflops)
    writer = MetricsWriter(save_dir, enabled=distributed.is_main(), resume_step=step, trace=cfg.run.trace_samples)
    bar = progress_bar(enabled=distributed.is_main() and cfg.run.progress_bar, total=cfg.schedule.max_steps,
                       initial=step)
    meter = Meter()
    metric_keys = ["loss", "mlm_loss", "mlm_acc"] + (["nsp_loss", "nsp_acc"] if prep.use_nsp else []) + \
        {"tacl": ["tacl_loss", "tacl_acc"], "taco": ["tc_loss", "tc_acc"], "mlm": []}[cfg.objective.objective]
    taco = cfg.objective.objective == "taco"
    rank = distributed.rank()
    batches = iter(loader)
    consecutive_bad, last_saved, preempted = 0, step, None
    dev: Optional[dict[str, torch.Tensor]] = None  # the last micro-batch (the export check reuses it)

    engine.train()
    while step < cfg.schedule.max_steps:
        applied, attempt, step_ids, lr = 0, 0, [], 0.0
        stop_usr1 = stop_term = False
        while applied < accum:
            try:
                batch = next(batches)
            except StopIteration:  # end of an epoch: streaming starts the next one
                batches = iter(loader)
                batch = next(batches)
            if cfg.run.trace_samples:
                step_ids.extend(batch["sample_ids"].tolist())
            # Dropout and the losses' draws: functions of (seed, step, micro-batch, rank).
            torch.manual_seed(mixed_seed(cfg.run.seed, step, attempt, rank))
            gen = torch.Generator().manual_seed(mixed_seed(cfg.run.seed, step, attempt, 1 << 20))
            attempt += 1
            dev = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            out = engine(dev["input_ids"], dev["token_type_ids"], dev["attention_mask"], dev["masked"],
                         with_embeddings=taco, with_nsp=prep.use_nsp)
            res = compute_losses(prep, out, dev, teacher=teacher, generator=gen)
            if (step + 1 in cfg.run.debug_nan_steps and rank == cfg.run.debug_nan_rank
                    and attempt <= cfg.run.debug_nan_attempts):
                res = StepLosses(total=res.total * float("nan"), values={**res.values, "loss": res.values["loss"] * float("nan")})
            bad, stop_usr1, stop_term = distributed.any_rank_flags(
                [not bool(torch.isfinite(res.values["loss"])), flag.usr1, flag.term])
            if bad:
                # Every rank skips this micro-batch together (no backward, no step): the ranks stay
                # in lockstep and the optimizer never sees the NaN.
                skipped_total += 1
                consecutive_bad += 1
                say(f"non-finite loss at step {step + 1}: micro-batch skipped ({consecutive_bad} in a row)")
                if consecutive_bad >= cfg.run.max_nonfinite:
                    raise RuntimeError(f"loss was NaN/inf for {consecutive_bad} micro-batches in a row, the last at "
                                       f"step {step + 1}: stopping (--max_nonfinite {cfg.run.max_nonfinite}). Lower "
                                       f"--lr, check the data, or resume from the last checkpoint")
                continue
            consecutive_bad = 0
            engine.backward(res.total)
            if applied == accum - 1:  # the rate this optimizer step uses
                lr = float(engine.get_lr()[0])
            engine.step()
            applied += 1
            am = batch["attention_mask"]
            lengths = am.sum(1)
            meter.add(res.values, tokens=int(lengths.sum()), samples=int(am.shape[0]),
                      flops=flops_model.batch_flops(tokens=int(lengths.sum()), sum_len_sq=int((lengths ** 2).sum()),
                                                    masked=int(batch["masked"].sum())))
        step += 1
        meter.steps += 1
        if bar is not None:
            bar.update(1)
        if cfg.run.trace_samples:
            writer.trace(step, distributed.all_gather_object(step_ids))
        chunk_end = step == cfg.run.stop_after_step and step < cfg.schedule.max_steps
        stopping = stop_usr1 or stop_term or chunk_end
        if step % cfg.run.log_every == 0 or step == cfg.schedule.max_steps or stopping:
            steps_in = meter.steps
            vals, elapsed = meter.reduce(metric_keys + list(Meter.COUNTS))
            world = distributed.world_size()
            mem, mem_kind = memory_gb(device)
            grad_norm = engine.get_global_grad_norm()
            record = {"step": step, **{k: vals[k] for k in metric_keys}, "lr": lr,
                      "grad_norm": float(grad_norm) if grad_norm is not None else None,
                      "loss_scale": float(getattr(engine.optimizer, "loss_scale", 1.0)),
                      "tokens_per_s": vals["tokens"] / elapsed, "samples_per_s": vals["samples"] / elapsed,
                      "tflops_per_s": vals["flops"] / elapsed / 1e12,
                      "mfu": (vals["flops"] / elapsed / (peak * world)) if peak else None,
                      "step_time_s": elapsed / max(steps_in, 1), "mem_gb": mem, "mem_kind": mem_kind,
                      "skipped_micro_batches": skipped_total, "time": time.time()}
            writer.log(record)
            if bar is not None:
                bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if step % cfg.run.save_every == 0 or step == cfg.schedule.max_steps or stopping:
            save(step)
            last_saved = step
        if stopping:
            if stop_usr1 or stop_term:
                preempted = "SIGUSR1" if stop_usr1 else "SIGTERM"
                say(f"pre-emption signal {preempted}: saved checkpoint at step {step}, exiting 0")
            else:
                preempted = "--stop_after_step"
                say(f"stopped after step {step} (--stop_after_step): saved checkpoint, exiting 0")
            break
    else:
        if last_saved != step:
            save(step)
    if bar is not None:
        bar.close()
    writer.close()
    if preempted is None:
        if cfg.run.export_dir and distributed.is_main():
            from pipeline.export import export, verify_export

            export(checkpoint.latest_checkpoint(save_dir)[1], cfg.run.export_dir)
            if dev is None:  # nothing trained in this process (resumed at max_steps)
                dev = {k: v.to(device) for k, v in next(iter(loader)).items()}
            check = verify_export(engine.module.net, cfg.run.export_dir, batch=dev, dtype=dtype,
                                  out=save_dir / "export_check")
            say(f"exported the student to {cfg.run.export_dir} (logits vs the engine: max |diff| "
                f"{check['max_abs_diff_same_dtype']:.3g} in {check['dtype']}, {check['max_abs_diff_fp32']:.3g} in fp32)")
        distributed.barrier()
        say(f"done: step {step}")
    return 0


def main(cfg: TrainConfig) -> int:
    return train(prepare(cfg))
