"""What a worker runs on: its device (allsync/distributed/devices.py) and its process groups with the other workers
(process_groups.py: world, expert-parallel, expert-data-parallel; the collectives the update and engines call).
The launch modes (allsync/launch/) start workers over these; nothing here knows a worker."""
