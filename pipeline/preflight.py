"""Pre-flight: every check of a training job that needs neither a process group nor a device.

Batch identity for the world size, the data (missing, empty, mixed, corrupted), the objective
against the data, the tokenizer against the model and the shards, the sequence length against the
model's positions, and the run folder's resume state. A bad job fails here in seconds, before any
GPU time is spent, with a message naming the flag, file or value.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pipeline import checkpoint, distributed
from pipeline.config import TrainConfig, load_ds_json, resolve_ds_config
from pipeline.data import DataInfo, check_objective_against_data, default_cache_root, inspect_data


@dataclass
class Prepared:
    """What `prepare` checked and resolved; `pipeline.trainer.train` runs it."""

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
