"""The job's phase clock (runtime/record/phases.py): nested phases named by their parent, seconds measured,
the table's shares of the top-level total."""
import time

from dflash_ray.runtime.record.phases import PhaseClock, phase


def test_phases_nest_time_and_add_up():
    clock = PhaseClock()
    with clock("inputs"):
        with phase(clock, "regeneration") as p:
            time.sleep(0.05)
            p["tokens"] = 1234
        with phase(None, "not timed") as q:   # no clock: nothing recorded, a dict to write into all the same
            q["tokens"] = 1
    with clock("training"):
        time.sleep(0.15)
    names = [r["phase"] for r in clock.rows]
    assert names == ["inputs", "inputs/regeneration", "training"]
    inputs, regen, training = clock.rows
    assert regen["seconds"] >= 0.05 and inputs["seconds"] >= regen["seconds"] and training["seconds"] >= 0.15
    table = clock.table().splitlines()
    assert table[2].split()[0] == "regeneration" and table[2].endswith("1,234")
    total = inputs["seconds"] + training["seconds"]            # nested rows are not counted twice
    assert table[-1].split() == ["total", f"{total:.1f}"]
    share = float(table[3].split()[2].rstrip("%"))
    assert abs(share - 100 * training["seconds"] / total) < 0.1


def test_a_phase_timed_elsewhere_counts_in_the_total():
    clock = PhaseClock()
    clock.add("start-up", 2.5)
    with clock("training"):
        pass
    assert clock.rows[0] == {"phase": "start-up", "seconds": 2.5}
    assert float(clock.table().splitlines()[-1].split()[1]) >= 2.5


def test_the_process_age_is_its_time_since_it_started():
    import subprocess
    import sys

    code = ("import time; time.sleep(1.0); from dflash_ray.runtime.record.phases import process_age_s; "
            "print(process_age_s())")
    t0 = time.monotonic()
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 1.0 <= age <= time.monotonic() - t0 + 0.05
