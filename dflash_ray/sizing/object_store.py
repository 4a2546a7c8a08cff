"""How much Ray object store the stream needs per node, and whether a node's store lives in memory.

At Qwen3-8B's shape a stream block is one plan batch of ~0.67 GB of features (16,384 tokens x 5 tapped
layers x 4,096 x bf16), and the run keeps blocks in the store at two places:
- Ray Data's operator budgets: the executor gives the target actors' output about a third of the store,
  and the equal split dispatches a round of blocks only when all of it is there while the trainers still
  hold the previous round, so about four blocks must fit in that third (the stream deadlocked with 26 MiB
  blocks in a 400 MB store: runtime/stream/pipeline.py `block_budget_mb`): 12 blocks of store;
- the flight window: up to `cluster.max_batches_in_flight` plan batches computed and not yet trained, plus
  the block each trainer holds and the one its iterator prefetches.
The need is the larger of the two. Ray puts a node's store in /dev/shm when it has room and otherwise in
/tmp on disk, with one warning in the raylet's log (a container's 64 MB /dev/shm does this): every block
then goes through the disk twice. No Ray and no torch here; runtime/cluster.py asks the nodes.
"""
from __future__ import annotations

import math

OPERATOR_SHARE = 3        # Ray Data gives an operator's outputs about 1/3 of the store
BLOCKS_PER_BUDGET = 4     # blocks that must fit in one operator's budget (the measured deadlock)
BLOCKS_PER_RANK = 2       # the block a trainer holds and the one its iterator prefetches


MAX_ROWS_PER_BLOCK = 64   # bounds the rows a round of blocks takes from the flight window
RAY_MAX_BLOCK_BYTES = 128 * 2 ** 20   # Ray Data's target_max_block_size (its default)


def rows_for_block(largest_bytes: float, block_mb: float, max_block_bytes: float = RAY_MAX_BLOCK_BYTES) -> int:
    """Plan batches a stream block holds: as many of the largest batch (`largest_bytes` through the stream)
    as fit in `block_mb`, kept under half of Ray Data's largest block (above it Ray Data splits an output block
    and the round-robin would no longer hand each rank whole blocks); 1 when either is 0; at most 64."""
    if block_mb <= 0 or largest_bytes <= 0:
        return 1
    budget = min(float(block_mb) * 2 ** 20, max_block_bytes / 2)
    return int(max(1, min(MAX_ROWS_PER_BLOCK, budget // largest_bytes)))


def stream_store_need(block_bytes: float, rows_per_block: int, in_flight_rows: int, ranks: int) -> dict:
    """Object store bytes one node's stream needs: blocks of `block_bytes` (the largest: `rows_per_block`
    plan batches), `in_flight_rows` plan batches in the flight window, `ranks` trainers on the node."""
    budget_blocks = OPERATOR_SHARE * BLOCKS_PER_BUDGET
    flight_blocks = math.ceil(in_flight_rows / max(1, rows_per_block)) + BLOCKS_PER_RANK * ranks
    blocks = max(budget_blocks, flight_blocks)
    return {"block_bytes": int(block_bytes), "rows_per_block": int(rows_per_block), "blocks": int(blocks),
            "bytes": int(blocks * block_bytes),
            "why": "operator budgets" if budget_blocks >= flight_blocks else "flight window"}


def store_problems(need: dict, nodes: dict) -> tuple[list[str], list[str]]:
    """(errors, warnings) for the nodes that host stream work. nodes: node id -> {"store": the node's object
    store bytes, "shm": /dev/shm's size there (None: no /dev/shm), "ip": for the message}. An error: the store
    holds fewer blocks than the stream needs (it would spill every block, or wait forever); a warning: the
    store is larger than /dev/shm, so Ray put it on disk."""
    errors, warnings = [], []
    gib = 2 ** 30
    for node, n in nodes.items():
        where = n.get("ip") or node[:12]
        store = float(n.get("store") or 0)
        if store and store < need["bytes"]:
            errors.append(
                f"node {where}: its Ray object store is {store / gib:.2f} GiB but the stream needs "
                f"~{need['bytes'] / gib:.2f} GiB ({need['blocks']} blocks of up to {need['block_bytes'] / 2**20:,.0f} MiB, "
                f"for the {need['why']}): start Ray there with a larger --object-store-memory (a local Ray: "
                f"cluster.object_store_memory), or lower cluster.max_batches_in_flight / data.max_tokens_per_batch")
        shm = n.get("shm")
        if store and shm is not None and shm < store:
            warnings.append(
                f"WARNING: node {where}: /dev/shm is {shm / gib:.2f} GiB, smaller than its {store / gib:.2f} GiB "
                f"object store, so Ray keeps the store on disk (/tmp) and every feature block goes through the "
                f"disk: give the container more shared memory (docker run --shm-size={math.ceil(store / gib) + 1}g) "
                f"or start Ray with --object-store-memory below /dev/shm's size")
    return errors, warnings
