"""`dflash-ray prepare` as a Ray Data job: the inputs cut into chunks (formats.plan_chunks: jsonl by lines,
parquet by row groups), each chunk tokenised by an actor of a pool (the tokenizer loaded once per actor),
the rows written by Ray Data's parquet writer. The same rows, ids and counts as the single-process path
(data/prepare.py's `add_conversation` decides for both); the shards hold the same samples in other files.

Each chunk's task returns its rows plus one row with sample_id -1 that carries the chunk's counts (JSON),
so one pass yields both: the dataset is materialised once, the counts read from it, the rest written.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from dflash_ray.config import DataConfig
from dflash_ray.data.formats import Chunk, plan_chunks
from dflash_ray.data.prepare import (Options, PrepareSummary, check_inputs, no_samples, prepare_chunk, rows_table,
                                     write_heldout)
from dflash_ray.data.shards import PREPARED_SCHEMA
from dflash_ray.tokenizer import load_tokenizer

COUNTS = "chunk_counts"   # the column of the counts row (dropped before writing)


class PrepareChunk:
    """An actor of the pool: tokenises whole chunks with its own copy of the tokenizer."""

    def __init__(self, tokenizer_path: str, options: dict):
        self.tok = load_tokenizer(tokenizer_path)
        # bad rows are recorded, never raised here: under data.on_bad_row=fail the driver raises the first
        # one in input order (the one the single-process path stops at), not whichever task failed first
        self.opts = Options(**{**options, "on_bad_row": "skip"})

    def __call__(self, batch: dict):
        import pyarrow as pa

        tables = []
        from dflash_ray.errors import UserError

        for item in batch["chunk"]:
            d = json.loads(item)
            try:
                table, summary = prepare_chunk(self.tok, Chunk(**{**d, "row_groups": tuple(d["row_groups"])}),
                                               self.opts)
                error = None
            except UserError as e:  # a whole-file problem (unreadable data, no conversation column)
                empty = rows_table({n: [] for n in PREPARED_SCHEMA.names})
                table, summary, error = empty, PrepareSummary(), str(e)
            state = {**summary.as_dict(), "order": [d["base"], d["start"]], "error": error}
            counts = pa.table({"sample_id": pa.array([-1], pa.int64()),
                               "input_ids": pa.array([[]], pa.list_(pa.int32())),
                               "loss_mask": pa.array([[]], pa.list_(pa.int8())),
                               "num_tokens": pa.array([0], pa.int32()), "num_supervised": pa.array([0], pa.int32()),
                               COUNTS: [json.dumps(state)]})
            tables += [table.append_column(COUNTS, pa.array([""] * table.num_rows, pa.string())), counts]
        return pa.concat_tables(tables)


def prepare_on_ray(input_path, tokenizer_path: str, output: str, *,
                   rows_per_task: int = DataConfig.prepare_rows_per_task, actors: int | None = None,
                   **options) -> PrepareSummary:
    """The Ray Data prepare on the connected cluster. Under data.on_bad_row=fail the first bad row in input
    order stops it with the single-process path's one line, and nothing is written."""
    import ray
    from ray.data import ActorPoolStrategy
    from ray.data.expressions import col

    from dflash_ray.atomic import atomic_dir
    from dflash_ray.errors import UserError

    opts = Options(**options)
    inputs = check_inputs(input_path, output, opts.shard_size)
    load_tokenizer(tokenizer_path)  # a bad tokenizer directory fails here, once, not in every actor
    chunks = plan_chunks(inputs, rows_per_task)
    size = actors or max(1, min(len(chunks), int(ray.cluster_resources().get("CPU", 1))))
    ds = ray.data.from_items([{"chunk": json.dumps(asdict(c))} for c in chunks], override_num_blocks=len(chunks))
    ds = ds.map_batches(PrepareChunk, batch_size=1, batch_format="numpy",
                        compute=ActorPoolStrategy(min_size=1, max_size=size), num_cpus=1,
                        fn_constructor_kwargs=dict(tokenizer_path=str(Path(tokenizer_path).resolve()),
                                                   options=asdict(opts)))
    done = ds.materialize()
    summary = PrepareSummary(output=str(output))
    counts_rows = done.filter(expr=col("sample_id") < 0).select_columns([COUNTS]).take_all()
    states = sorted((json.loads(r[COUNTS]) for r in counts_rows), key=lambda st: st["order"])  # input order
    for state in states:
        if state.get("error"):  # the driver raises it, in input order, as the single-process path would
            raise UserError(state["error"])
        part = PrepareSummary.from_dict(state)
        if opts.on_bad_row == "fail" and part.bad_rows.bad_rows:
            first = min((rows[0][1], reason) for reason, rows in part.bad_rows.first.items())[1]
            raise UserError(part.bad_rows.messages[first])
        summary.merge(part)
    if summary.samples == 0:
        raise no_samples(input_path, summary, opts.min_supervised)
    with atomic_dir(output) as dest:
        written = dest / "ray"
        done.filter(expr=col("sample_id") >= 0).drop_columns([COUNTS]).write_parquet(
            str(written), min_rows_per_file=opts.shard_size)
        # prepare's own names (part-NNNNN.parquet): what `prepare` replaces and `plan` lists
        for i, f in enumerate(sorted(written.glob("*.parquet"))):
            os.replace(f, dest / f"part-{i:05d}.parquet")
        summary.shards = len(list(dest.glob("part-*.parquet")))
        for leftover in written.iterdir():
            leftover.unlink()
        written.rmdir()
        write_heldout(dest, summary)
    return summary
