"""The job floor: this process's place in a job. Launch (launch.py) and relaunch (relaunch.py), local test jobs
(spawn.py), the process group and its Runtime (join.py, runtime.py), the degrees and their mesh
(dims.py), layout checks (checks.py), the only collectives (comm.py), the hang watchdog
(watchdog.py), device / dtype / seeds (devices.py), the CPU allocator (host_malloc.py). Imports
nothing above config (tests/unit/test_boundaries.py)."""
