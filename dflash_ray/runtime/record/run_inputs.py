"""The run's record of its inputs (<run.dir>/run_inputs.json) and the check a resume makes against it.

Exactly-once resume needs the plan (a function of the shards' samples and the plan's config keys) and
the checkpoints' drafter to be those of the run's first start, and the tokens it trains to be the same.
`resolve_spec` calls `check_run_inputs` with the resolved RunSpec (`runtime/spec.py`) once it has scanned
the shards: a first start writes the record, a resume compares with it and refuses in one line naming
the shard, the samples or the config key.
"""
from __future__ import annotations

import json

from dflash_ray.errors import UserError
from dflash_ray.run_layout import RunLayout


def read_run_inputs(run_dir) -> dict | None:
    """The inputs record of a run directory (None when there is none, or it is unreadable)."""
    path = RunLayout(run_dir).run_inputs
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_run_inputs(run_dir, inputs: dict) -> None:
    """Record what this run is made of (`resolve_spec` writes it while the run has no checkpoint, so a
    later invocation of the same run.name, which resumes, can check it is made of the same)."""
    from dflash_ray.atomic import write_json_atomic

    write_json_atomic(RunLayout(run_dir).run_inputs, inputs)


def first_start(run_dir, resuming: bool) -> bool:
    """No registered checkpoint (`resuming`: the run has one) and no tokens' digest recorded yet:
    check_run_inputs will record one."""
    if resuming:
        return False
    return not ((read_run_inputs(run_dir) or {}).get("shards") or {}).get("contents")


# the drafter fields a checkpoint's weights depend on, and the config key that changes each
_DRAFTER_KEYS = {"hidden_size": "model.target_path", "vocab_size": "model.target_path",
                 "head_dim": "model.target_path", "num_target_layers": "model.target_path",
                 "target_layer_ids": "model.target_layer_ids", "num_hidden_layers": "model.num_draft_layers",
                 "block_size": "model.block_size", "mask_token_id": "model.mask_token_id",
                 "intermediate_size": "model.drafter_intermediate_size",
                 "num_attention_heads": "model.drafter_num_attention_heads",
                 "num_key_value_heads": "model.drafter_num_key_value_heads", "attention_bias": "model.target_path"}


def check_run_inputs(spec, tcfg, scan=None, log=print, *, resuming: bool) -> None:
    """Exactly-once resume needs the plan (a function of the shards' samples) and the checkpoints' drafter
    to be those of the run's first invocation, and the tokens it trains to be the same. While the run has
    no checkpoint, record them in <run_dir>/run_inputs.json: the samples' fingerprint and the tokens'
    digest (data.shards.samples_fingerprint, contents_digest: independent of the file layout), the files'
    layout (sizes, rows, footer digests, modification times), the drafter's shape, the plan's config keys and seed. Once it has
    one, a rerun of the same run.name resumes from it, and must find the same, else one line naming the
    shard, the samples or the key. Shards re-written in another layout (another prepare engine or shard
    size) with the same samples and tokens resume; the tokens are read for that only when the files
    changed (files as recorded, by listing and footer, are not read further).

    spec: the run's RunSpec (runtime/spec.py). scan: the shards' `scan_shards` (resolve_spec's pass); None (`dflash-ray export`): the shards are not
    read and nothing is written, only the checkpoint's drafter shape is compared. resuming: Ray Train has
    registered a checkpoint of the run (runtime/checkpoints.py RunCheckpoints.exists)."""
    from dflash_ray.data.shards import contents_digest, samples_fingerprint
    from dflash_ray.model.drafter import drafter_config
    from dflash_ray.model.export import _field

    d = spec.drafter
    config = drafter_config(tcfg, d.num_draft_layers, d.block_size, d.mask_token_id, list(d.target_layer_ids),
                            d.intermediate_size, d.num_attention_heads, d.num_key_value_heads)
    now = {"drafter": {k: _field(config, k) for k in _DRAFTER_KEYS}, "target_path": spec.target_path,
           "plan": {**{k: _json_value(getattr(spec.plan, k)) for k in _PLAN_KEYS if k != "seed"}, "seed": spec.seed}}
    recorded = read_run_inputs(spec.run_dir)
    where = f"(recorded in {RunLayout(spec.run_dir).run_inputs} at its first run)"
    if scan is None:  # an export: the checkpoint and the drafter's shape only
        if resuming and recorded is not None:
            _check_drafter(spec, recorded, now, where)
        return
    shards = {**samples_fingerprint(scan.lengths), "files": scan.files}
    old = (recorded or {}).get("shards") or {}
    if not resuming or recorded is None:  # a fresh run (or one recorded before this check existed)
        same = old.get("digest") == shards["digest"] and old.get("files") == scan.files and old.get("contents")
        shards["contents"] = old["contents"] if same else (scan.contents or contents_digest(spec.shards))
        now = {"shards": shards, **now}
        if recorded != now:
            write_run_inputs(spec.run_dir, now)
        return
    relaid = _check_shards(spec, old, shards, where)
    _check_drafter(spec, recorded, now, where)
    plan_then = recorded.get("plan") or {}
    moved = [k for k in _PLAN_KEYS if k in plan_then and plan_then[k] != now["plan"][k]]
    if moved:  # the cursor points into the old plan (checked after the target: another target moves La too)
        k = moved[0]
        raise UserError(f"config key '{_PLAN_KEYS[k]}': run '{spec.name}' planned its batches with {plan_then[k]}, "
                        f"this config gives {now['plan'][k]} {where}; resuming its checkpoint under another plan "
                        "would not be exactly-once: set it back, or train under a new run.name")
    if relaid is not None:  # same samples and tokens in other files: the record follows the new layout
        write_run_inputs(spec.run_dir, {**recorded, "shards": {**old, "files": scan.files, "contents": relaid}})
        log(f"{spec.shards}: the shard files changed since run '{spec.name}' started (another layout, or "
            f"rewritten), with the same {shards['samples']} samples, lengths and tokens: resuming")


def _check_shards(spec, old: dict, now: dict, where: str) -> str | None:
    """The resume's shards against the record: refuse other samples (the plan would differ) or other
    tokens (the run would train other data). Returns the tokens' digest when the same samples and tokens
    are in other files (the record is then updated), None when nothing changed."""
    from dflash_ray.data.shards import contents_digest, fingerprint_change

    if "digest" not in old:   # recorded by an earlier version: per file only (that check, as it was)
        change = fingerprint_change(old, {k: {f: v[f] for f in ("bytes", "rows", "footer")}
                                          for k, v in now["files"].items()})
        if change:
            _refuse_files(spec, change, where)
        return None
    if old["digest"] == now["digest"] and old.get("files") == now["files"]:
        return None           # the recorded files, unchanged: no token is read
    contents = None
    if old["digest"] == now["digest"]:
        contents = contents_digest(spec.shards)   # other files: are the tokens the same?
        if contents == old.get("contents") or not old.get("contents"):
            return contents
    # refused: name the file where the layout is the recorded one apart from some files, else the samples
    files_then = old.get("files") or {}
    change = fingerprint_change(files_then, now["files"])
    if change and any(files_then[k] == now["files"].get(k) for k in files_then):
        _refuse_files(spec, change, where)
    if contents is not None:
        what = (f"the tokens changed since run '{spec.name}' started (the same {now['samples']} samples with the "
                "same lengths, other input_ids or loss_mask)")
    else:
        counts = [f"{old[k]} -> {now[k]} {k}" for k in ("samples", "tokens", "supervised") if old.get(k) != now[k]]
        what = (f"the samples changed since run '{spec.name}' started ("
                + (", ".join(counts) if counts else "the same counts, other sample ids or lengths") + ")")
    raise UserError(f"{spec.shards.rstrip('/')}: {what} {where}; resuming its checkpoint with other data would not "
                    "be exactly-once: restore the shards, or train them under a new run.name")


def _refuse_files(spec, change: tuple, where: str) -> None:
    name, what, total = change
    more = f", {total - 1} more shard(s) differ" if total > 1 else ""
    raise UserError(f"{spec.shards.rstrip('/')}/{name}: shard {what} since run '{spec.name}' started{more} "
                    f"{where}; resuming its checkpoint with other data would not be exactly-once: restore "
                    f"the shards, or train them under a new run.name")


def _check_drafter(spec, recorded: dict, now: dict, where: str) -> None:
    old = recorded.get("drafter") or {}
    diffs = [k for k in _DRAFTER_KEYS if k in old and old[k] != now["drafter"][k]]
    if diffs:
        k = diffs[0]
        target = f" (target {recorded.get('target_path')} then, {spec.target_path} now)" \
            if recorded.get("target_path") != spec.target_path else ""
        raise UserError(f"config key '{_DRAFTER_KEYS[k]}': run '{spec.name}' has a checkpoint of a drafter with "
                        + ", ".join(f"{j} {old[j]}" for j in diffs) + " but this config gives "
                        + ", ".join(f"{j} {now['drafter'][j]}" for j in diffs)
                        + f"{target} {where}: use a new run.name (model.init_from can start it from this run's export)")


# what the plan depends on besides the shards (PlanSpec fields and the seed), with the key that sets each
_PLAN_KEYS = {"boundaries": "data.bucket_boundaries", "max_tokens_per_batch": "data.max_tokens_per_batch",
              "overlong": "data.overlong", "chunk_batches": "data.chunk_batches", "min_tokens": "model.block_size",
              "strategy": "data.interleave", "attention_tokens": "data.attention_tokens",
              "num_anchors": "model.num_anchors", "max_block_tokens_per_batch": "model.max_block_tokens_per_batch",
              "step_batches": "cluster.drafter_workers x train.grad_accum", "seed": "seed"}


def _json_value(v):
    return list(v) if isinstance(v, tuple) else v
