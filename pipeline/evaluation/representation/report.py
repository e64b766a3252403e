"""Run models over the analysis data and write the report: metrics.json, the PNGs and README.md.

The metrics themselves are in `metrics.py`, the inputs in `inputs.py`, the figures in `plots.py`
(all in pipeline/evaluation/representation/); this module loads models, runs them without gradients, and puts the
numbers together. Shape legend: B sequences, L tokens, D hidden size, N tokens.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from pipeline.evaluation.models import parse_model, resolve_device, unique_labels
from pipeline.evaluation.representation import plots
from pipeline.evaluation.representation.inputs import (
    AnalysisSequence,
    SourceStats,
    collate,
    first_sentence_text,
    is_mds_dir,
    read_mds_sequences,
    read_text_sequences,
    structural_special_ids,
)
from pipeline.modeling import similarity as analysis
from preprocessing.cli import knob
from preprocessing.errors import UsageError
from preprocessing.shard_format import vocabulary_of


def _model_arg(text: str) -> tuple[str, Path]:
    return parse_model(text)


@dataclass
class AnalyzeConfig:
    """Everything `pipeline/analyze.py` takes; one knob per flag."""

    models: list[tuple[str, Path]] = knob(
        help="HF model folder (trainer export or any BERT folder); repeat to compare models",
        flag="--model",
        repeat=True,
        parse=_model_arg,
        metavar="[LABEL=]DIR",
        default_factory=list,
    )
    data: Optional[Path] = knob(
        None, "MDS shard folder (with index.json and tokenizer/) or a .txt/.jsonl text file", parse=Path, required=True
    )
    out: Optional[Path] = knob(None, "report folder", parse=Path, required=True)
    run: Optional[Path] = knob(None, "a trainer save_dir: plot the intra/inter gap over its checkpoints", parse=Path)
    run_start: Optional[Path] = knob(
        None,
        "the HF folder the run started from (--init_from), plotted as step 0 "
        "(default: RUN/config.json's init_from when it still exists)",
        parse=Path,
    )
    tokenizer: Optional[Path] = knob(None, "tokenizer folder for model folders that have none", parse=Path)
    max_sequences: int = knob(512, "sequences analysed")
    max_seq_len: int = knob(128, "text input: tokens per sequence (shards keep their length)")
    pack_text: bool = knob(
        False, "text input: pack consecutive lines of a document into one sequence (default: a line each)"
    )
    batch_size: int = knob(32, "sequences per forward pass")
    isotropy_tokens: int = knob(10000, "last-layer vectors drawn for the isotropy summary")
    isotropy_pairs: int = knob(20000, "random token pairs for the mean random-pair cosine")
    heatmap_text: Optional[str] = knob(None, "the sentence of the heatmap (default: the first sentence of --data)")
    heatmap_max_tokens: int = knob(24, "tokens of the heatmap sentence")
    seed: int = knob(0, "seed of the token draws")
    device: str = knob("auto", "auto (cuda when available), cpu, cuda, cuda:1, ...")

    def validate(self) -> None:
        for flag in ("max_sequences", "batch_size", "isotropy_tokens", "isotropy_pairs", "heatmap_max_tokens"):
            if getattr(self, flag) < 2:
                raise UsageError(f"--{flag} must be >= 2 (got {getattr(self, flag)})")
        self.models = unique_labels(self.models)


def load_encoder(path: Path, *, tokenizer_dir: Optional[Path] = None):
    """(BertModel-like encoder in eval mode, tokenizer) from an HF folder.

    A folder saved from BertForPreTraining or BertForMaskedLM loads its encoder through AutoModel;
    its heads are not needed here.
    """
    from transformers import AutoModel, AutoTokenizer

    if not (path / "config.json").is_file():
        raise UsageError(f"--model {path}: not a Hugging Face model folder (no config.json)")
    encoder = AutoModel.from_pretrained(path)
    tok_dir = (
        path
        if (path / "tokenizer_config.json").is_file()
        or (path / "tokenizer.json").is_file()
        or (path / "vocab.txt").is_file()
        else tokenizer_dir
    )
    if tok_dir is None:
        raise UsageError(f"--model {path} has no tokenizer files; pass --tokenizer DIR")
    return encoder.eval(), AutoTokenizer.from_pretrained(tok_dir)


def vocab_fingerprint(tokenizer) -> str:
    """Same string <=> same vocabulary (ids, specials, normalisation): preprocessing.shard_format's."""
    return vocabulary_of(tokenizer).fingerprint


class AnalysisData:
    """The analysis inputs for each tokenizer: shards once (their ids are fixed), text once per vocabulary."""

    def __init__(self, cfg: AnalyzeConfig):
        self.cfg = cfg
        self.path = cfg.data
        self.is_mds = is_mds_dir(cfg.data)
        if not self.is_mds and not cfg.data.is_file():
            raise UsageError(f"--data {cfg.data}: neither an MDS folder with index.json nor a text file")
        self._cache: dict[str, tuple[list[AnalysisSequence], SourceStats]] = {}
        self.shard_tokenizer = None
        if self.is_mds:
            from transformers import AutoTokenizer

            tok_dir = cfg.data / "tokenizer"
            if not tok_dir.is_dir():
                raise UsageError(f"--data {cfg.data}: no tokenizer/ folder beside index.json (the builder writes one)")
            self.shard_tokenizer = AutoTokenizer.from_pretrained(tok_dir)

    def sequences(self, tokenizer, *, label: str) -> tuple[list[AnalysisSequence], SourceStats]:
        if self.is_mds:
            if vocab_fingerprint(tokenizer) != vocab_fingerprint(self.shard_tokenizer):
                raise UsageError(
                    f"model {label!r} uses another vocabulary than the shards in {self.path}; "
                    "analyse it on a text file instead (--data FILE.txt)"
                )
            tokenizer = self.shard_tokenizer
        key = vocab_fingerprint(tokenizer)
        if key not in self._cache:
            if self.is_mds:
                self._cache[key] = read_mds_sequences(
                    self.path,
                    special_ids=structural_special_ids(tokenizer),
                    max_sequences=self.cfg.max_sequences,
                    vocab_size=len(tokenizer),
                    unk_id=tokenizer.unk_token_id,
                )
            else:
                self._cache[key] = read_text_sequences(
                    self.path,
                    tokenizer=tokenizer,
                    max_seq_len=self.cfg.max_seq_len,
                    max_sequences=self.cfg.max_sequences,
                    pack=self.cfg.pack_text,
                )
        return self._cache[key]


@torch.inference_mode()
def analyse_encoder(
    encoder,
    *,
    seqs: Sequence[AnalysisSequence],
    pad_id: int,
    batch_size: int,
    device: torch.device,
    isotropy_tokens: int,
    isotropy_pairs: int,
    seed: int,
) -> dict:
    """Per-layer similarity metrics (layer 0 = embedding output) and the last layer's isotropy summary.

    The isotropy vectors are the last-layer states of `isotropy_tokens` analysed tokens drawn
    uniformly (seeded) from the whole data, not its first tokens, which would all come from the first
    few documents and share their topic.
    """
    encoder.to(device)
    _check_lengths(encoder, seqs=seqs)
    stats: list[analysis.SimilarityStats] = []
    last_chunks: list[torch.Tensor] = []
    gen = torch.Generator().manual_seed(seed)
    chosen_N = _isotropy_choice(seqs, isotropy_tokens=isotropy_tokens, generator=gen)
    offset = 0
    for start in range(0, len(seqs), batch_size):
        batch = collate(seqs[start : start + batch_size], pad_id=pad_id)
        out = _forward(encoder, batch=batch, device=device)
        sentence_BL = batch["sentence"].to(device)
        if not stats:
            stats = [analysis.SimilarityStats() for _ in out.hidden_states]
        for layer_stats, hidden_BLD in zip(stats, out.hidden_states):
            layer_stats.update(hidden_BLD.float(), sentence_BL=sentence_BL)
        # Boolean indexing walks the batch row by row, the same order as chosen_N counts the tokens.
        last_nD = out.hidden_states[-1][sentence_BL >= 0].float().cpu()
        last_chunks.append(last_nD[chosen_N[offset : offset + last_nD.shape[0]]])
        offset += last_nD.shape[0]
    assert offset == chosen_N.shape[0], (offset, chosen_N.shape[0])
    last_ND = torch.cat(last_chunks)
    return {
        "layers": [{"layer": i, **s.result()} for i, s in enumerate(stats)],
        "isotropy": {
            "layer": len(stats) - 1,
            "random_pair_cosine": analysis.random_pair_cosine(last_ND, num_pairs=isotropy_pairs, generator=gen),
            "top_direction_variance_share": analysis.top_direction_variance_share(last_ND),
            "num_tokens": last_ND.shape[0],
            "num_pairs": isotropy_pairs,
        },
    }


def _check_lengths(encoder, *, seqs: Sequence[AnalysisSequence]) -> None:
    """Refuses sequences longer than the model's max_position_embeddings (if it has one)."""
    max_pos = getattr(encoder.config, "max_position_embeddings", None)
    too_long = [len(s.input_ids) for s in seqs if max_pos is not None and len(s.input_ids) > max_pos]
    if too_long:
        raise UsageError(
            f"{len(too_long)} sequences are longer ({max(too_long)}) than the model's "
            f"max_position_embeddings ({max_pos}); lower --max_seq_len"
        )


def _isotropy_choice(
    seqs: Sequence[AnalysisSequence], *, isotropy_tokens: int, generator: torch.Generator
) -> torch.Tensor:
    """chosen_N: bool over all analysed tokens (sentence id >= 0) of `seqs`, in order, True for
    `isotropy_tokens` of them drawn uniformly with `generator`."""
    total = sum(sum(1 for s in seq.sentence_ids if s >= 0) for seq in seqs)
    chosen_N = torch.zeros(total, dtype=torch.bool)
    chosen_N[torch.randperm(total, generator=generator)[:isotropy_tokens]] = True
    return chosen_N


def _forward(encoder, *, batch: dict[str, torch.Tensor], device: torch.device):
    """The encoder's output, every layer's hidden states, for one collated batch; refuses token ids past
    the model's vocabulary."""
    if int(batch["input_ids"].max()) >= encoder.config.vocab_size:
        raise UsageError(
            f"token id {int(batch['input_ids'].max())} >= the model's vocab_size "
            f"{encoder.config.vocab_size}: data and model use different vocabularies"
        )
    return encoder(
        input_ids=batch["input_ids"].to(device),
        attention_mask=batch["attention_mask"].to(device),
        token_type_ids=batch["token_type_ids"].to(device),
        output_hidden_states=True,
    )


@torch.inference_mode()
def sentence_heatmap(
    encoder, *, tokenizer, text: str, max_tokens: int, device: torch.device
) -> tuple[list[str], list[list[float]]]:
    """Tokens of `text` (specials left out, cut to max_tokens) and their last-layer cosine matrix."""
    enc = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_tokens + 2)
    hidden_LD = encoder.to(device)(**{k: v.to(device) for k, v in enc.items()}).last_hidden_state[0]
    specials = structural_special_ids(tokenizer)
    keep = [i for i, t in enumerate(enc["input_ids"][0].tolist()) if t not in specials]
    if len(keep) < 2:
        raise UsageError(f"heatmap sentence {text!r} has fewer than 2 tokens")
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"][0, keep].tolist())
    return tokens, analysis.token_similarity_matrix(hidden_LD[keep]).cpu().tolist()


def _summary(result: dict) -> dict:
    last = result["layers"][-1]
    return {
        "intra_sentence": last["intra_sentence"],
        "intra_context": last["intra_context"],
        "inter_context": last["inter_context"],
        "gap": last["gap"],
        **result["isotropy"],
    }


def training_curve(run_dir: Path, *, data: AnalysisData, cfg: AnalyzeConfig, device: torch.device) -> list[dict]:
    """Last-layer metrics of every checkpoint of one run, in step order."""
    try:
        from pipeline.training.checkpoint import list_checkpoints
        from pipeline.training.hf_export import load_student
    except ImportError as e:
        raise UsageError(f"--run needs the trainer's pipeline.training package ({e})") from e
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise UsageError(f"--run {run_dir}: no complete checkpoints found")
    start = cfg.run_start or _init_from(run_dir)
    points = []
    for step, ckpt in ([(0, start)] if start is not None else []) + checkpoints:
        if step == 0 and ckpt == start:
            encoder, tokenizer = load_encoder(start, tokenizer_dir=cfg.tokenizer)
        else:
            model, tokenizer = load_student(ckpt)
            encoder = model.bert.eval()
        seqs, _ = data.sequences(tokenizer, label=f"{run_dir}@{step}")
        result = analyse_encoder(
            encoder,
            seqs=seqs,
            pad_id=tokenizer.pad_token_id,
            batch_size=cfg.batch_size,
            device=device,
            isotropy_tokens=cfg.isotropy_tokens,
            isotropy_pairs=cfg.isotropy_pairs,
            seed=cfg.seed,
        )
        points.append({"step": step, "checkpoint": str(ckpt), **_summary(result)})
    return points


def _init_from(run_dir: Path) -> Optional[Path]:
    """The pre-trained folder a run was initialised from (RUN/config.json), when it still exists."""
    try:
        init = json.loads((run_dir / "config.json").read_text()).get("model", {}).get("init_from")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return Path(init) if isinstance(init, str) and (Path(init) / "config.json").is_file() else None


def run_analysis(cfg: AnalyzeConfig) -> dict:
    """Analyse every model (and the run's checkpoints), write cfg.out/{metrics.json, *.png, README.md}.

    Returns the metrics dict that metrics.json holds.
    """
    t0 = time.time()
    if not cfg.models and cfg.run is None:
        raise UsageError("nothing to analyse: pass --model DIR and/or --run RUN_DIR")
    device = resolve_device(cfg.device)
    data = AnalysisData(cfg)
    cfg.out.mkdir(parents=True, exist_ok=True)
    metrics: dict = {
        "data": {},
        "models": {},
        "figures": {},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items() if k != "models"},
    }
    heat_panels = []
    heat_text = cfg.heatmap_text
    for label, path in cfg.models:
        model, source, heat_text = _analyse_model(label, path, cfg=cfg, data=data, device=device, heat_text=heat_text)
        metrics["data"][model["vocab"]] = source
        heat_panels.append((label, model["heatmap"]["tokens"], model["heatmap"]["similarity"]))
        metrics["models"][label] = model
    if cfg.models:
        import numpy as np

        curves = {label: m["layers"] for label, m in metrics["models"].items()}
        metrics["figures"]["layerwise"] = plots.plot_layerwise(curves, path=cfg.out / "layerwise.png").name
        metrics["figures"]["heatmap"] = plots.plot_heatmaps(
            [(label, tokens, np.asarray(sim)) for label, tokens, sim in heat_panels], path=cfg.out / "heatmap.png"
        ).name
    if cfg.run is not None:
        points = training_curve(cfg.run, data=data, cfg=cfg, device=device)
        metrics["run"] = {"path": str(cfg.run), "checkpoints": points}
        metrics["figures"]["training_gap"] = plots.plot_training_gap(
            points,
            path=cfg.out / "training_gap.png",
            title=f"run {cfg.run.resolve().name}: last-layer similarity over training",
        ).name
    metrics["wall_s"] = round(time.time() - t0, 1)
    (cfg.out / "metrics.json").write_text(json.dumps(metrics, indent=1, ensure_ascii=False))
    (cfg.out / "README.md").write_text(report_markdown(metrics), encoding="utf-8")
    return metrics


def _analyse_model(label: str, path: Path, *, cfg: AnalyzeConfig, data, device, heat_text: Optional[str]):
    """(one model's metrics entry, what its data was (sequences, tokens, skipped), the heatmap's text: the
    first model's first sentence unless given)."""
    encoder, tokenizer = load_encoder(path, tokenizer_dir=cfg.tokenizer)
    seqs, source = data.sequences(tokenizer, label=label)
    result = analyse_encoder(
        encoder, seqs=seqs, pad_id=tokenizer.pad_token_id, batch_size=cfg.batch_size, device=device,
        isotropy_tokens=cfg.isotropy_tokens, isotropy_pairs=cfg.isotropy_pairs, seed=cfg.seed,
    )  # fmt: skip
    if heat_text is None:
        shown = data.shard_tokenizer or tokenizer
        heat_text = first_sentence_text(seqs, tokenizer=shown, max_tokens=cfg.heatmap_max_tokens)
    tokens, sim = sentence_heatmap(
        encoder, tokenizer=tokenizer, text=heat_text, max_tokens=cfg.heatmap_max_tokens, device=device
    )
    entry = {
        "path": str(path),
        "vocab": vocab_fingerprint(tokenizer),
        "unk_share": source.unk_tokens / max(source.tokens, 1),
        "last_layer": _summary(result),
        **result,
        "heatmap": {"text": heat_text, "tokens": tokens, "similarity": sim},
    }
    return entry, asdict(source), heat_text


def _f(x: float) -> str:
    return f"{x:.3f}"


def report_markdown(metrics: dict) -> str:
    """report/README.md: what was analysed, the last-layer table, and the figures in reading order."""
    lines = ["# Representation analysis", ""]
    for fp, src in metrics["data"].items():
        skipped = ", ".join(f"{k}: {v}" for k, v in src["skipped"].items()) or "none"
        lines.append(
            f"Data: `{src['source']}` ({src['kind']}, vocabulary {fp}): {src['sequences']} sequences, "
            f"{src['sentences']} sentences, {src['tokens']} tokens analysed; left out: {skipped}."
        )
        lines += [f"Note: {note}." for note in src.get("notes", ())]
    lines += [
        "",
        "Special tokens ([CLS], [SEP], [PAD], [MASK]) and padding are left out of every number. "
        "Cosine means: intra-sentence = different tokens of one sentence (TaCL); intra-context = different "
        "tokens of one sequence, inter-context = tokens of two different sequences (TACO); "
        "random pairs and top principal direction: isotropy of the last layer.",
        "",
    ]
    if metrics["models"]:
        lines += [
            "| model | intra-sentence | intra-context | inter-context | gap | random-pair cos | "
            "top-PC variance share | [UNK] share |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for label, m in metrics["models"].items():
            s = m["last_layer"]
            lines.append(
                f"| {label} | {_f(s['intra_sentence'])} | {_f(s['intra_context'])} | {_f(s['inter_context'])}"
                f" | {_f(s['gap'])} | {_f(s['random_pair_cosine'])} | {_f(s['top_direction_variance_share'])}"
                f" | {_f(m['unk_share'])} |"
            )
        lines += ["", "(last layer)", ""]
    figs = metrics["figures"]
    n = 1
    if "layerwise" in figs:
        lines += [f"{n}. Layer-wise similarity, one line per model: ![layerwise]({figs['layerwise']})", ""]
        n += 1
    if "heatmap" in figs:
        text = next(iter(metrics["models"].values()))["heatmap"]["text"]
        lines += [
            f"{n}. Token-by-token cosine of one sentence ({text!r}), last layer, one panel per model: "
            f"![heatmap]({figs['heatmap']})",
            "",
        ]
        n += 1
    if "training_gap" in figs:
        lines += [
            f"{n}. Intra/inter-context gap over the checkpoints of `{metrics['run']['path']}`: "
            f"![training gap]({figs['training_gap']})",
            "",
            "| step | intra-sentence | intra-context | inter-context | gap |",
            "|---|---|---|---|---|",
        ]
        for p in metrics["run"]["checkpoints"]:
            lines.append(
                f"| {p['step']} | {_f(p['intra_sentence'])} | {_f(p['intra_context'])} | "
                f"{_f(p['inter_context'])} | {_f(p['gap'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def print_summary(metrics: dict, *, out: Path) -> None:
    """The last-layer numbers of every model, one line each, on stdout (warnings on stderr)."""
    for label, m in metrics["models"].items():
        s = m["last_layer"]
        if m["unk_share"] > 0.05:
            print(
                f"[analyze] warning: {100 * m['unk_share']:.0f}% of {label}'s tokens are [UNK]: its vocabulary "
                "does not cover this text, so its similarities say little",
                file=sys.stderr,
            )
        print(
            f"[analyze] {label}: last layer intra-sentence {s['intra_sentence']:.4f} intra-context "
            f"{s['intra_context']:.4f} inter-context {s['inter_context']:.4f} gap {s['gap']:.4f} "
            f"random-pair {s['random_pair_cosine']:.4f} top-PC {s['top_direction_variance_share']:.4f}"
        )
    print(f"[analyze] wrote {out}/metrics.json and README.md ({metrics['wall_s']} s)")
