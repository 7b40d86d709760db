"""Starting the workers and driving them: the training loop (recipes/dapo.py) sees one `WorkerGroup`
(group.py) whatever the mode, and a run's mode is picked by `group.launch_mode`.

    group.py           the WorkerGroup protocol, WorkerFailure / WorkerTimeout, the launch-mode registry
    local.py           one worker in this process (--no-ray, or one worker)
    ray_actors.py      Ray actors in a placement group, one bundle per device; placement and failure helpers
    spmd.py            one process per device started by torchrun / accelerate launch (elastic restarts)
    disaggregated.py   the baseline layout: generators and trainers apart (benchmarks/allsync.py)
    supervise.py       restarts after a lost worker, from the newest good checkpoint
    process_groups.py  the workers' torch.distributed groups (world, expert-parallel, expert-data-parallel)
    devices.py         the worker's device and its host-memory reuse

To add a launch mode: one module with its group class under `@register_launch_mode` (group.py says what it
provides), here (chosen automatically in its `order`) or in a module of your own named by `run.imports` and chosen
by `run.launch: <its name>`; every module of this folder is imported when a mode is picked.
"""
