"""The driver's progress lines (runtime/progress.py)."""
from __future__ import annotations


def test_progress_lines_end_with_the_runs_last_step(ray_session, capsys):
    """In a log (no terminal) the driver prints a progress line every few seconds; the run's last step
    must be the last line even when it came after the last poll (a rerun's log ended on 'step 9/10')."""
    import time

    import ray

    from dflash_ray.runtime.progress import Progress

    @ray.remote(num_cpus=0)
    class Coord:
        def __init__(self):
            self.step = 9

        def set_step(self, step):
            self.step = step

        def progress(self):
            return {"step": self.step, "total_steps": 10, "loss": 1.0, "tokens_per_second": 5.0,
                    "failures_survived": 0, "heldout_tau": None, "epoch": 0}

    coord = Coord.remote()
    with Progress(coord, enabled=True):
        time.sleep(1.5)                      # polled: step 9 printed
        ray.get(coord.set_step.remote(10))   # the last step, then the run ends before the next poll
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("step ")]
    assert lines[0].startswith("step 9/10") and lines[-1].startswith("step 10/10"), lines
    ray.kill(coord)
