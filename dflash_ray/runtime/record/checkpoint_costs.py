"""What each checkpoint of a run's invocation cost, for the run record (record.py) to report: the seconds
training waited for it, its write and upload seconds, its bytes. A checkpoint is an attempt's step (a step
can be checkpointed again after a restart from an earlier one); its facts arrive in two calls, in either
order: the report's return (rank 0's `ray.train.report`) and the end of its upload."""
from __future__ import annotations


class CheckpointCosts:
    def __init__(self):
        self.checkpoints: list[dict] = []

    def _entry(self, attempt, step: int) -> dict:
        for c in reversed(self.checkpoints):
            if c["step"] == int(step) and c.get("attempt") == attempt:
                return c
        c = {"step": int(step), "attempt": attempt}
        self.checkpoints.append(c)
        return c

    def reported(self, attempt, step: int, seconds: float, upload: str | None, write_seconds: float | None,
                 nbytes: int | None, write: str | None) -> None:
        """Training waited `seconds` for the checkpoint (the write or, with write="background", the host
        snapshot; the ledger, the barrier, and the upload unless it is async)."""
        c = self._entry(attempt, step)
        c.update(seconds=float(seconds), upload=upload, write_seconds=write_seconds, bytes=nbytes)
        if write is not None:
            c["write"] = write

    def uploaded(self, attempt, step: int, seconds: float) -> None:
        self._entry(attempt, step)["upload_seconds"] = float(seconds)

    def cost(self) -> dict:
        """Count, seconds training waited (total, max), write and upload seconds, bytes."""
        def vals(key):
            return [float(c[key]) for c in self.checkpoints if c.get(key) is not None]

        waited, write, up, nbytes = vals("seconds"), vals("write_seconds"), vals("upload_seconds"), vals("bytes")
        return {"count": len(self.checkpoints), "total_seconds": sum(waited), "max_seconds": max(waited, default=0.0),
                "total_write_seconds": sum(write), "max_write_seconds": max(write, default=0.0),
                "total_upload_seconds": sum(up), "max_upload_seconds": max(up, default=0.0),
                "total_bytes": int(sum(nbytes)), "max_bytes": int(max(nbytes, default=0))}
