"""The run directory, every file of it, in one place. Nothing here imports torch or Ray: the CLI, the
plots, the summary and the tests read a run through this.

    <run.dir>/
      run_inputs.json     what the plan and the checkpoints were made from; compared on resume (record/run_inputs.py)
      ledger.jsonl        one line per committed optimizer step: epoch, step, plan positions, buckets (ledger.py)
      metrics.jsonl       one line per step: loss, tokens/s, timings, checkpoint costs (record.py)
      events.jsonl        restarts, rollbacks, stops, failed evaluations, removed checkpoints (record.py)
      quarantine.json     plan batches set aside after failing their worker group repeatedly (quarantine.py)
      evals.jsonl         held-out tau during training, one line per evaluation (record.py)
      best/               the exported drafter of the best held-out tau so far (record.py)
      .evals/step_N/      an evaluation's export while it runs (moved to best/ or removed)
      export/             the drafter of the latest checkpoint, Hugging Face format (EXPORT_FILES: model/export.py)
      summary.json        the run's summary (summary.py)
      plots/              `dflash-ray plot`'s PNGs (plots.py)
      trackers.json       each tracker's run id, so a resumed run logs into the same tracker run (trackers.py)
      tensorboard/, wandb/  the trackers' own files (trackers.py)
      ray_train/          Ray Train's storage (checkpoints) unless train.storage_path is set
    the demo world (with no data.input; demo/world.py):
      corpus.jsonl, tokenizer/, target/ (trained once), regenerated.jsonl (+ .regenerated.done),
      shards/, heldout.jsonl
"""
from __future__ import annotations

from pathlib import Path

RUN_INPUTS = "run_inputs.json"
LEDGER = "ledger.jsonl"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
EVALS = "evals.jsonl"
BEST = "best"
EVALS_WORK = ".evals"
EXPORT = "export"
SUMMARY = "summary.json"
PLOTS = "plots"
TENSORBOARD = "tensorboard"
WANDB = "wandb"
TRACKERS = "trackers.json"
QUARANTINE = "quarantine.json"
RAY_TRAIN = "ray_train"
# what an export holds (model/export.py writes it, publish.py uploads it): named here, where reading the names
# costs no torch (`dflash-ray push` checks an export before anything heavy loads)
EXPORT_CONFIG = "config.json"
EXPORT_WEIGHTS = "model.safetensors"
EXPORT_CARD = "README.md"
# the drafter's code an export ships for transformers' trust_remote_code (modeling_dflash.py imports the rest)
EXPORT_CODE = ("modeling_dflash.py", "draft_core.py", "speculative.py", "layers.py", "attention.py")
EXPORT_FILES = (EXPORT_CONFIG, EXPORT_WEIGHTS, EXPORT_CARD, *EXPORT_CODE)
# the demo world's inputs
CORPUS = "corpus.jsonl"
TOKENIZER = "tokenizer"
TARGET = "target"
REGENERATED = "regenerated.jsonl"
REGENERATED_DONE = ".regenerated.done"
HELDOUT = "heldout.jsonl"


class RunLayout:
    """The paths of one run directory."""

    __slots__ = ("root",)

    def __init__(self, run_dir):
        self.root = Path(run_dir)

    def __repr__(self) -> str:
        return f"RunLayout({str(self.root)!r})"

    def __truediv__(self, name: str) -> Path:
        return self.root / name

    run_inputs = property(lambda self: self.root / RUN_INPUTS)
    ledger = property(lambda self: self.root / LEDGER)
    metrics = property(lambda self: self.root / METRICS)
    events = property(lambda self: self.root / EVENTS)
    quarantine = property(lambda self: self.root / QUARANTINE)
    evals = property(lambda self: self.root / EVALS)
    best = property(lambda self: self.root / BEST)
    export = property(lambda self: self.root / EXPORT)
    summary = property(lambda self: self.root / SUMMARY)
    plots = property(lambda self: self.root / PLOTS)
    tensorboard = property(lambda self: self.root / TENSORBOARD)
    wandb = property(lambda self: self.root / WANDB)
    ray_train = property(lambda self: self.root / RAY_TRAIN)
    corpus = property(lambda self: self.root / CORPUS)
    tokenizer = property(lambda self: self.root / TOKENIZER)
    target = property(lambda self: self.root / TARGET)
    regenerated = property(lambda self: self.root / REGENERATED)
    regenerated_done = property(lambda self: self.root / REGENERATED_DONE)
    heldout = property(lambda self: self.root / HELDOUT)

    def eval_work(self, step: int) -> Path:
        return self.root / EVALS_WORK / f"step_{int(step)}"
