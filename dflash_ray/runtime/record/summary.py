"""summary.json: what a run did, from the files it left (ledger, metrics) and the run record's report.

The ledger check takes the finished epochs from the latest checkpoint's cursor: every epoch before the
cursor's was trained to its end, so the ledger must cover each of them exactly once (even an epoch the
ledger lacks entirely). Steps skipped for a non-finite loss or gradient are counted from the ledger (the
timeline of the weights: steps rolled back after a failure and trained again count once, as they ended)."""
from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np

from dflash_ray.runtime.record.record import last_metrics
from dflash_ray.run_layout import RunLayout
from dflash_ray.runtime.record.ledger import read_jsonl, verify_ledger


def build_summary(run_spec, plans, plan_summary: dict, report: dict, *, latest: tuple, started: float,
                  wall_seconds: float) -> dict:
    """plans: the run's RunPlans (spec.py); the ledger is checked against each epoch's planned batches.
    latest: (cursor, location) of the run's latest registered checkpoint (runtime/checkpoints.py
    RunCheckpoints.latest)."""
    metrics = last_metrics(run_spec.run_dir)
    files = RunLayout(run_spec.run_dir)
    ledger = read_jsonl(files.ledger)
    cursor, checkpoint = latest
    finished = list(range(cursor.epoch))
    epochs = sorted({int(r["epoch"]) for r in ledger} | set(finished))
    check = verify_ledger(ledger, {e: plans(e).num_batches for e in epochs}, finished_epochs=finished)
    now = [m for m in metrics if m.get("time", 0) >= started]   # steps trained by this invocation
    base = now or metrics                                      # (a rerun of a finished run trains none)
    steady = base[1:]
    span = (steady[-1]["time"] - base[0]["time"]) if steady else 0.0
    tps = sum(int(m["tokens"]) for m in steady) / span if span > 0 else 0.0
    bps = sum(int(m.get("block_tokens", 0)) for m in steady) / span if span > 0 else 0.0
    tokens, block_tokens = sum(int(m["tokens"]) for m in metrics), sum(int(m.get("block_tokens", 0)) for m in metrics)
    tokens_now = sum(int(m["tokens"]) for m in now)
    c = run_spec.cluster
    skipped = [int(r["step"]) for r in ledger if r.get("skipped") == "nonfinite"]
    skipped_oom = [int(r["step"]) for r in ledger if r.get("skipped") == "oom"]
    finite_losses = [m["loss"] for m in metrics if isinstance(m.get("loss"), (int, float)) and math.isfinite(m["loss"])]
    return {
        "run": run_spec.name, "run_dir": run_spec.run_dir,
        "steps": int(metrics[-1]["step"]) if metrics else 0,
        "epochs": sorted({int(m["epoch"]) for m in metrics}),
        "epochs_finished": finished,
        # two units: context tokens (what the target computed) and block tokens (anchor blocks x block size, what
        # the drafter trained); their ratio is the density a throughput is comparable at
        "tokens": tokens, "tokens_per_second": tps, "wall_seconds": wall_seconds,
        "block_tokens": block_tokens, "block_tokens_per_second": bps,
        "block_tokens_per_token": block_tokens / tokens if tokens else None,
        "tokens_this_invocation": tokens_now,
        "end_to_end_tokens_per_second": tokens_now / wall_seconds if wall_seconds > 0 else 0.0,
        "final_loss": finite_losses[-1] if finite_losses else None,   # of the last step that trained
        "skipped_nonfinite": len(skipped), "skipped_nonfinite_steps": skipped[:100],
        # train.oom_split: batches trained in slices after running out of device memory; steps skipped because
        # a batch did not fit even as single rows
        "oom_splits": sum(int(m.get("oom_splits", 0)) for m in metrics),
        "oom_split_steps": [int(m["step"]) for m in metrics if m.get("oom_splits")][:100],
        "skipped_oom": len(skipped_oom), "skipped_oom_steps": skipped_oom[:100],
        # plan batches set aside after ending their worker group train.quarantine_after times in a row
        "quarantined": report.get("quarantined", []),
        "final_train_tau": metrics[-1].get("train_tau") if metrics else None,
        "plan": {k: plan_summary.get(k) for k in ("batches", "tokens", "padding_efficiency", "strategy", "order")},
        "batches_per_step": run_spec.batches_per_step, "drafter_workers": c.drafter_workers,
        "target_workers": c.target_workers,
        "failures_survived": report["failures_survived"], "trainer_restarts": report["trainer_restarts"],
        "target_restarts": report["target_restarts"], "rolled_back_steps": report["rolled_back_steps"],
        "max_batches_in_flight": report["max_batches_in_flight"], "flight_window": report["window"],
        "stream_rows_per_block": report.get("rows_per_block", 1),
        "unregistered_checkpoints_removed": report.get("removed_checkpoints", []),
        "target_actors": report["targets"], "checkpoints": report["checkpoints"],
        "checkpoint_cost": report.get("checkpoint_cost"),
        "target_busy_by_bucket": report["target_busy_by_bucket"],
        "token_store": report.get("token_store"),
        "stream_segments": report.get("segments"),
        "placement": report.get("placement"), "feature_traffic": report.get("feature_traffic"),
        # train.features: the mode and why; hybrid: the batches read back instead of computed, the entries
        # written, damaged ones found (recomputed), failed writes (then online)
        "features": run_spec.features_why, "feature_cache": report.get("feature_cache"),
        "offline_features": report.get("offline_features"),   # offline: the target's pass before training
        "target_busy_max_over_min": report["target_busy_max_over_min"],
        "timeline_seconds": report.get("timeline", {}),
        # tau against the target tokens trained so far: does more data or more steps help?
        "heldout_tau_during_training": [{"step": e["step"], "tau": e["tau"],
                                         "target_tokens": _tokens_through(metrics, e["step"])}
                                        for e in report.get("evals", [])],
        "best": _best(run_spec, report.get("evals", [])),
        "measured": measured_rates(report["targets"], metrics, c.drafter_workers),
        "model": asdict(run_spec.drafter),
        "target_path": run_spec.target_path, "use_gpu": c.use_gpu, "compute_dtype": run_spec.compute_dtype,
        "checkpoint": checkpoint, "ledger": check,
        "export": str(files.export),
    }


def _best(run_spec, evals: list) -> dict | None:
    """The drafter with the best held-out tau during training, kept exported in <run.dir>/best."""
    if not evals:
        return None
    top = max(evals, key=lambda e: e["tau"])
    return {"step": top["step"], "tau": top["tau"], "dir": str(RunLayout(run_spec.run_dir).best)}


def measured_rates(targets: dict, metrics: list, drafter_workers: int) -> dict:
    """Per-device rates for the capacity model, each in its side's unit: target context tokens per busy
    second of an actor; drafter block tokens (and context tokens, at this run's density) per compute
    second of a worker (median over steps; data waits excluded)."""
    busy = sum(t["busy_s"] for t in targets.values())
    tokens = sum(t.get("tokens", 0) for t in targets.values())
    per_worker = [m["tokens"] / drafter_workers / m["compute_seconds"] for m in metrics[1:]
                  if m.get("compute_seconds")]
    blocks_per_worker = [m.get("block_tokens", 0) / drafter_workers / m["compute_seconds"] for m in metrics[1:]
                         if m.get("compute_seconds") and m.get("block_tokens")]
    waits = [m.get("wait_seconds", 0.0) for m in metrics[1:]]
    steps = [m.get("step_seconds", 0.0) for m in metrics[1:]]
    return {"target_tokens_per_second_per_actor": tokens / busy if busy > 0 else None,
            "drafter_tokens_per_second_per_worker": float(np.median(per_worker)) if per_worker else None,
            "drafter_block_tokens_per_second_per_worker": float(np.median(blocks_per_worker)) if blocks_per_worker else None,
            "trainer_wait_fraction": float(sum(waits) / sum(steps)) if sum(steps) > 0 else None}


def model_card_facts(run_spec, summary: dict | None) -> dict:
    """The run's facts for the export's model card (model/export.py CARD_FIELDS), from its summary.json
    (None: what the spec alone says, e.g. `dflash-ray export` of a run that never finished)."""
    s = summary or {}
    tau = s.get("heldout_tau") or None   # the card says tau and how many prompts, not the histograms
    if tau:
        tau = {k: {f: tau[k][f] for f in ("tau", "prompts", "outputs_match_greedy")} for k in ("initial", "trained")
               if tau.get(k)}
    return {"target": run_spec.target_path, "data": run_spec.shards or None, "steps": s.get("steps"),
            "tokens": s.get("tokens"), "epochs": run_spec.train.epochs, "heldout_tau": tau}


def _tokens_through(metrics: list, step: int) -> int:
    """Context tokens trained in steps 1..step (metrics.jsonl: each step's tokens, the last line of a step
    that a restart repeated counting once)."""
    per_step = {int(m["step"]): int(m.get("tokens", 0)) for m in metrics if "step" in m}
    return sum(t for s, t in per_step.items() if s <= step)


def oom_report(run_dir, summary: dict, memory: dict) -> dict | None:
    """What running out of device memory cost the run, beside the memory model (`memory`: sizing/memory.py's
    report for the run's plan): the buckets of the batches trained in slices or skipped, each bucket's
    estimated step peak, and the measured peak by then (GPU: `device_peak_gib`, torch's max allocated). One
    line for the console, the figures for summary.json; None when nothing ran out."""
    steps = set(summary.get("oom_split_steps") or []) | set(summary.get("skipped_oom_steps") or [])
    if not steps:
        return None
    ledger = {int(r["step"]): r for r in read_jsonl(RunLayout(run_dir).ledger)}
    metrics = {int(m["step"]): m for m in last_metrics(run_dir)}
    buckets = sorted({int(b) for s in steps for b in ledger.get(s, {}).get("buckets", []) if int(b) >= 0})
    estimate = {b: (memory.get("drafter_by_bucket") or {}).get(b) for b in buckets}
    peaks = [metrics[s]["device_peak_gib"] for s in steps if "device_peak_gib" in metrics.get(s, {})]
    peak = max(peaks) if peaks else None
    est = ", ".join(f"bucket {b} {v / 2**30:,.2f} GiB" if v else f"bucket {b} unknown" for b, v in estimate.items())
    line = (f"out of device memory: {summary.get('oom_splits', 0)} batch(es) trained in slices, "
            f"{summary.get('skipped_oom', 0)} step(s) skipped (steps {sorted(steps)[:10]}); the memory model's "
            f"step peak for their buckets: {est or 'unknown'}; measured peak "
            f"{f'{peak:,.2f} GiB' if peak is not None else 'not measured (CPU)'}: lower "
            "model.max_block_tokens_per_batch or data.max_tokens_per_batch for those buckets, or set "
            "train.recompute_layers=true")
    return {"line": line, "buckets": buckets, "estimate_gib": {b: (v / 2**30 if v else None) for b, v in estimate.items()},
            "measured_peak_gib": peak}
