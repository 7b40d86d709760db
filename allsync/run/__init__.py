"""A worker's run: what one process (a Ray actor, a torchrun rank or the in-process worker) holds and does.

    worker.py         RLWorker: the frozen base loaded once, its engine, its policy; step, evaluate, save, load
    engine_link.py    the rollout engine a worker builds and the adapter sync into it, checked
    scoring.py        rewards and their shaping (reward processes)
    evaluation.py     held-out records from the producer's episodes
    sharded_state.py  a policy's part of a checkpoint under expert parallelism
    checkpoint.py     the checkpoint's files: safetensors + JSON, written atomically

It calls the update (allsync/update/) and the producers; nothing below calls it.
"""
